"""A burst onto two decode replicas lands on both (issue 27's reproduction, as a test).

1 prefill + 2 decode workers (real Ray actors, NIXL, gRPC, the default ``kv_aware``
policy), six greedy requests of 64-token prompts and 60 output tokens sent at the same
moment, every one handed off. Each is routed while the earlier ones are still in prefill,
before any decode worker could report them: only the router's own count of what it
routed spreads them. Before that count, all six went to decode-0.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import collect, request, wait_blocks_released

NUM_REQUESTS = 6


def test_a_burst_of_simultaneous_requests_lands_on_both_decode_workers(tiny_model_dir, tmp_path):
    config = cluster_config(tiny_model_dir)
    config["decode"]["replicas"] = 2
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        barrier = threading.Barrier(NUM_REQUESTS)

        def send(i: int) -> str:
            # Distinct prompts: no prefix cache makes one worker cheaper than the other.
            prompt = [(7 * i + 13 * j) % 500 + 3 for j in range(64)]
            req = request(
                prompt,
                max_tokens=60,
                disaggregation=pb.DISAGGREGATION_ALWAYS,
                output=pb.OutputOptions(return_timing=True),
            )
            barrier.wait()
            token_ids, _, final = collect(stub, req)
            assert len(token_ids) == 60
            assert final.timing.prefill_worker == "prefill-0"
            return final.timing.decode_worker

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            per_worker = Counter(pool.map(send, range(NUM_REQUESTS)))
        assert set(per_worker) == {"decode-0", "decode-1"}, per_worker
        assert max(per_worker.values()) - min(per_worker.values()) <= 1, per_worker
        status = wait_blocks_released(stub)
        incoming = {w.name: w.num_incoming for p in status.pools for w in p.workers}
        assert incoming == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}
    finally:
        assert stop_cluster(served) == 0
