"""What the router process loads: no torch in its modules, the wire format to the workers
or the gRPC client side; no protobuf or gRPC in the router's core flow (only the servicer,
``router/server.py``, speaks them). A fresh interpreter checks each module, since this
test process has torch loaded already."""

from __future__ import annotations

import json
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
    "router.http.app",
    "router.http.server",
    "workers.protocol.wire",
    "workers.protocol.metrics",
    "cluster.client",
    "cluster.cli_client",
    # The serving driver: the router runs in its process, beside bring-up and restart,
    # which read the model's architecture and place the ranks without torch.
    "cluster.serve",
    "cluster.bringup",
    "cluster.replicas",
    "cluster.restart",
    # router.processes > 1: the other router processes and their link to the first.
    "cluster.router_process",
    "cluster.router_hub",
    "workers.models.arch_config",
    "workers.models.rank_layout",
)
# The flow a front end drives; the HTTP front end must not pull in gRPC through it.
PROTOBUF_FREE = ("router.router", "router.status", "router.metrics", "router.http.server")


def loaded(module: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of ``packages`` that importing ``module`` loads (a few, sorted)."""
    code = (
        f"import json, sys, {module}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})[:3]))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_does_not_load_torch(module):
    assert loaded(module, ("torch",)) == []


@pytest.mark.parametrize("module", PROTOBUF_FREE)
def test_the_core_flow_loads_no_protobuf_or_grpc(module):
    assert loaded(module, ("proto", "grpc", "google")) == []
