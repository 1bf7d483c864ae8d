"""Whole clusters whose pools use pipeline stages (the tiny model's 2 layers, one a stage).

Real Ray actors, gloo process groups, NIXL transfers in which each decode rank pulls
exactly the layers and heads it owns from the prefill ranks that hold them, real gRPC.
What must hold: the tokens are, token for token, the single-process engine's (the
aggregated TP=1 reference), disaggregated and aggregated; every (layer, head) of every
prompt block crosses over exactly once; every KV block is free afterwards.

The fast case is the issue's: prefill PP=2 -> decode TP=1. Decode stages (the decode
side's receives split by layer, and its steps pipelined through two processes) and
TP x PP on both sides are ``slow``.
"""

from __future__ import annotations

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_parallel_cluster import assert_outputs_and_hand_off

LAYOUTS = [  # (prefill (tp, pp), decode (tp, pp))
    pytest.param((1, 2), (1, 1), id="P-PP2-D1"),
    pytest.param((1, 1), (1, 2), id="P1-D-PP2", marks=pytest.mark.slow),
    pytest.param((2, 2), (2, 2), id="P-TP2xPP2-D-TP2xPP2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("prefill", "decode"), LAYOUTS)
def test_pipeline_layouts_match_the_single_process_engine(
    tiny_model_dir, tmp_path, reference, prefill, decode
):
    config = cluster_config(tiny_model_dir)
    for role, (tp, pp) in (("prefill", prefill), ("decode", decode)):
        config[role]["tensor_parallel"] = tp
        config[role]["pipeline_parallel"] = pp
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        layouts = {
            p.role: (p.workers[0].tensor_parallel, p.workers[0].pipeline_parallel)
            for p in status.pools
        }
        assert layouts == {"prefill": prefill, "decode": decode}
        assert_outputs_and_hand_off(stub, tiny_model_dir, reference)
    finally:
        assert stop_cluster(served) == 0
