"""The layer-wise KV hand-off between TP/PP replicas in a whole cluster: real Ray actors
(one per rank), gloo, a NIXL agent per rank, gRPC.

Prefill TP=2 streams into decode PP=2 (``kv_transfer.layerwise: on``): every prefill rank
writes its heads of every layer group, every decode rank (each a pipeline stage) reserves
its layers' blocks (docs/kvtransfer.md, "TP/PP replicas"). Long prompts (two prefill
chunks, one layer per write) must give the single-process engine's tokens; a short one
keeps the whole-request hand-off with the same tokens; the prefill worker counts the
long ones' streams as done, none failed; no block stays in use.
"""

from __future__ import annotations

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import collect, request, wait_blocks_released
from tests.e2e.test_layerwise_cluster import (
    LONG_A,
    LONG_B,
    MIN_TOKENS,
    SHORT,
    num_streams,
    wait_streams,
)

pytestmark = pytest.mark.slow


def test_tp_prefill_streams_into_a_pipeline_decode_replica(tiny_model_dir, tmp_path):
    from workers import LLM, SamplingParams

    config = cluster_config(tiny_model_dir)
    config["prefill"]["tensor_parallel"] = 2
    config["decode"]["pipeline_parallel"] = 2
    config["kv_transfer"].update(
        layerwise="on", layerwise_min_tokens=MIN_TOKENS, timeout_seconds=30, lease_seconds=60
    )
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
    prompts = [LONG_A, LONG_B, SHORT]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [list(out.token_ids) for out in llm.generate(prompts, params)]
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        for i, prompt in enumerate(prompts):
            req = request(prompt, max_tokens=16, disaggregation=pb.DISAGGREGATION_ALWAYS)
            assert collect(stub, req, timeout=120)[0] == want[i], f"prompt {i}"
        wait_streams(served, "done", 2)  # the long ones only
        assert num_streams(served, "failed") == 0
        wait_blocks_released(stub)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
