"""A whole cluster with ``kv_cache.dtype: fp8_e4m3``: real Ray actors, real NIXL, real gRPC.

The FP8 blocks (values and their per-row scales) go from the prefill worker to the decode
worker as they are; the disaggregated stream must equal the aggregated one and the
single-process engine's with the same FP8 cache, token for token, and no block may stay
in use. (The fast subset is tests/workers/test_fp8_kv_engine.py: engines and two real NIXL
connectors in one process.)
"""

from __future__ import annotations

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request, wait_blocks_released

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp8_cluster(tiny_model_dir, tmp_path_factory):
    config = cluster_config(tiny_model_dir)
    config["kv_cache"]["dtype"] = "fp8_e4m3"
    served = start_cluster(config, tmp_path_factory.mktemp("fp8-cluster"))
    yield served
    assert stop_cluster(served) == 0, served.output()[-4000:]


def test_fp8_disaggregated_equals_aggregated_and_the_fp8_engine(fp8_cluster, tiny_model_dir):
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512, kv_cache_dtype="fp8_e4m3")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [*PROMPTS, TOKEN_PROMPT]
    want = [list(out.token_ids) for out in llm.generate(prompts, params)]
    stub = fp8_cluster.stub()
    for prompt, tokens in zip(prompts, want, strict=True):
        disagg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_ALWAYS))
        agg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_NEVER))
        assert disagg[0] == agg[0] == tokens
        assert disagg[1] == agg[1]
    wait_blocks_released(stub)
