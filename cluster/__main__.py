"""``python -m cluster [CONFIG]``: serve a cluster config (the ``ray job submit`` entry point)."""

import sys

from cluster.serve import main

sys.exit(main())
