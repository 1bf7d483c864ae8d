"""DeepSeek-V3 (multi-head latent attention, a latent KV cache) served by a disaggregated
cluster whose pools split it differently: a tensor-parallel prefill pool (2 ranks, the
heads and each expert's intermediate dimension split, the latent replicated) hands its
latent blocks to a tensor- and expert-parallel decode pool (2 ranks, half the experts each,
tokens dispatched all-to-all), over real NIXL transfers, Ray actors and gloo groups. Each
decode rank reads each block once, from the prefill rank the round robin names
(kvtransfer/tp_mapping.py). Disaggregated and aggregated outputs equal the single-process
engine's token for token (float32, greedy), and every KV block is released afterwards.
"""

from __future__ import annotations

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request, wait_blocks_released


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    from cluster.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("e2e-deepseek") / "tiny-v3", "deepseek-v3", "tiny")


def test_tp_prefill_to_ep_decode_of_a_latent_cache_equals_the_single_process_engine(
    deepseek_dir, tmp_path
):
    from workers import LLM, SamplingParams

    prompts = [*PROMPTS, TOKEN_PROMPT]
    llm = LLM(str(deepseek_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [list(out.token_ids) for out in llm.generate(prompts, params)]
    del llm
    config = cluster_config(deepseek_dir)
    config["prefill"]["tensor_parallel"] = 2
    config["decode"].update(tensor_parallel=2, expert_parallel=2, expert_dispatch="alltoall")
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        for i, prompt in enumerate(prompts):
            disagg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_ALWAYS))
            agg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_NEVER))
            assert disagg[0] == agg[0] == want[i], f"prompt {i}"
        wait_blocks_released(stub)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
