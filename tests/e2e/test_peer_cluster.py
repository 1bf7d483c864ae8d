"""Peer pull (G4) in a real cluster: a prefix computed on one worker is pulled by another.

Two decode workers that prefill themselves (``disaggregation: never``, round robin, so
that consecutive requests alternate), ``kv_cache.peer_sharing: true`` (every pair of
workers is introduced for KV transfer), real Ray actors, NIXL and gRPC. decode-0 computes
a 64-token prompt; the same prompt plus 16 tokens then goes to decode-1, which pulls the
8 blocks decode-0 holds instead of computing them (its ``cached_prompt_tokens`` says so),
with the tokens of ``LLM.generate``. With every transfer failing (``BATON_KV_FAULTS``),
decode-1 recomputes, with the same tokens. Either way no block stays in use anywhere
(decode-0's lease ended by decode-1's notice).
"""

from __future__ import annotations

import time

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import collect, request, wait_blocks_released

PREFIX = [(11 * j) % 400 + 5 for j in range(64)]  # 8 blocks of 8
PROMPT = PREFIX + [(7 * j) % 300 + 9 for j in range(16)]


@pytest.fixture(scope="module")
def want(tiny_model_dir) -> list[int]:
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return list(llm.generate([PROMPT], params)[0].token_ids)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("faults", "pulled_tokens"), [("", 64), ("fail_every=1", 0)], ids=["pulled", "failed"]
)
def test_a_prefix_computed_on_one_worker_is_pulled_by_the_other(
    tiny_model_dir, tmp_path, want, faults, pulled_tokens
):
    config = cluster_config(tiny_model_dir, policy="round_robin", disaggregation="never")
    config["prefill"]["replicas"] = 0
    config["decode"]["replicas"] = 2
    config["kv_cache"]["peer_sharing"] = True
    config["kv_transfer"]["allow_fault_injection"] = bool(faults)
    served = start_cluster(config, tmp_path, env={"BATON_KV_FAULTS": faults} if faults else None)
    try:
        stub = served.stub()
        _, _, first = collect(
            stub, request(PREFIX, max_tokens=2, output=pb.OutputOptions(return_timing=True))
        )
        assert first.timing.decode_worker == "decode-0"
        assert first.usage.cached_prompt_tokens == 0
        time.sleep(1.0)  # decode-0's reports (every <= 0.25 s) carry its hashes to the router
        tokens, _, final = collect(
            stub, request(PROMPT, max_tokens=12, output=pb.OutputOptions(return_timing=True))
        )
        assert final.timing.decode_worker == "decode-1"
        assert tokens == want
        # decode-1 computed the prompt minus what it pulled from decode-0.
        assert final.usage.cached_prompt_tokens == pulled_tokens
        wait_blocks_released(stub)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
