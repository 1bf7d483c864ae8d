"""The SLA planner's loop on a real cluster (issue 38): a load step grows the prefill pool and
a quiet period shrinks it, every stream's tokens equal to the single-process engine's.

1 prefill + 1 decode worker (Ray actors, NIXL, gRPC), `planner.enabled` with a tick every
2 s. The TTFT target is set below what any prefill pool of a 2-core machine reaches (5 ms:
a prompt's hand-off alone takes longer), and the ITL target far above, so that under load
the decision is certain (prefill up to the budget's 2, decode held) and the test checks
the loop's mechanics rather than this machine's speed: the router's observations feed the
fits, the decision is acted on through live scaling on Ray (a new replica placed, its
model loaded, introduced to the decode worker, routed to), and once the clients stop,
two quiet windows past the cooldown take the pool back to 1 through a drain.
"""

from __future__ import annotations

import time

import pytest

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import wait_blocks_released
from tests.e2e.test_scaling_cluster import Streams

pytestmark = pytest.mark.slow  # ~1.5 min on the 2-core VM: a replica joins and leaves


def pool_sizes(stub) -> list[int]:
    status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
    return [len(p.workers) for p in status.pools]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_load_step_grows_prefill_and_quiet_shrinks_it(tiny_model_dir, reference, tmp_path):
    config = cluster_config(
        tiny_model_dir, policy="round_robin", scale_max_replicas=3, scale_down_grace_seconds=10
    )
    config["planner"] = {
        "enabled": True,
        "interval_seconds": 2,
        "ttft_p90_ms": 5,
        "itl_p90_ms": 10000,
        "max_workers": 3,
        "cooldown_seconds": 4,
        "down_windows": 2,
        "warmup_steps": 0,
    }
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        assert pool_sizes(stub) == [1, 1]
        with Streams(stub) as streams:
            wait_for(lambda: pool_sizes(stub) == [2, 1], 120, "the planner to add prefill")
            num_then = len(streams.results)
            wait_for(lambda: len(streams.results) >= num_then + 12, 60, "12 more answers")
        assert not streams.errors, streams.errors[:3]
        wait_for(lambda: pool_sizes(stub) == [1, 1], 90, "the planner to shrink prefill")
        wrong = [(i, t) for i, t, _ in streams.results if t != reference[i]]
        assert not wrong, wrong[:3]
        assert "prefill-1" in {w for _, _, w in streams.results}  # the new one served
        wait_blocks_released(stub)
    finally:
        code = stop_cluster(served)
    log = served.output()
    assert "planner: (1, 1) -> (2, 1) (scale up" in log, log[-4000:]
    assert "planner: (2, 1) -> (1, 1) (scale down" in log, log[-4000:]
    assert code == 0, log[-4000:]
