"""The Helm chart's values schema embeds the cluster config's schema under ``config``.

One source of truth: ``helm/baton/values.schema.json`` is written by hand except for its
``config`` property, which this module generates from ``cluster/config.py`` (pydantic's
schema of the models, made self-contained by ``cluster.config_schema.json_schema``):

    python -m cluster.helm_schema [helm/baton/values.schema.json]

tests/helm/test_values_schema.py fails when the file is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.config_schema import json_schema

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "helm" / "baton" / "values.schema.json"


def config_values_schema() -> dict[str, Any]:
    """The ``config`` value's schema: the cluster config's, as ``python -m cluster`` loads it."""
    schema = json_schema(ClusterConfig)
    schema["description"] = "Baton's cluster config (docs/config.md), rendered into a ConfigMap"
    return schema


def render(chart_schema: dict[str, Any]) -> str:
    """The values schema with its ``config`` property regenerated."""
    chart_schema["properties"]["config"] = config_values_schema()
    return json.dumps(chart_schema, indent=2) + "\n"


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else SCHEMA_PATH
    path.write_text(render(json.loads(path.read_text())))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
