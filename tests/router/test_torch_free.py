"""The router process does not load torch: its modules, the wire format to the workers
and the gRPC client side import only torch-free code (a fresh interpreter checks, since
this test process has torch loaded already)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCH_FREE = (
    "router.server",
    "router.router",
    "router.metrics",
    "router.status",
    "workers.protocol.wire",
    "workers.protocol.metrics",
    "cluster.client",
    "cluster.cli_client",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_does_not_load_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", f"{module} loads torch: {out.stdout.strip()}"
