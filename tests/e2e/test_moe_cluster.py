"""A Mixture-of-Experts model served by a disaggregated cluster whose pools split it
differently: a tensor-parallel prefill pool (every expert's intermediate dimension split
over 2 ranks) hands its KV to an expert-parallel decode pool (each of 2 ranks holds half
of the experts, tokens dispatched all-to-all), over real NIXL transfers, Ray actors and
gloo groups. Disaggregated and aggregated outputs equal the single-process engine's token
for token (float32, greedy), every KV block is released afterwards, and killing one rank
of the expert-parallel decode replica mid-stream neither hangs the replica's other rank
nor loses a stream: they migrate, with the same tokens, and the replica is restarted.
"""

from __future__ import annotations

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request, wait_blocks_released
from tests.e2e.test_parallel_cluster import (
    STREAM_TOKENS,
    STREAMS,
    assert_dead_decode_rank_migrates,
)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from cluster.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("e2e-moe") / "tiny-qwen3-moe", "qwen3-moe", "tiny")


@pytest.fixture(scope="module")
def moe_reference(moe_model_dir) -> dict[int, list[int]]:
    from workers import LLM, SamplingParams

    llm = LLM(str(moe_model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [*PROMPTS, TOKEN_PROMPT]
    return {i: list(out.token_ids) for i, out in enumerate(llm.generate(prompts, params))}


def _config(model_dir, decode_replicas: int = 1) -> dict:
    config = cluster_config(model_dir)
    config["prefill"]["tensor_parallel"] = 2
    config["decode"].update(
        tensor_parallel=2,
        expert_parallel=2,
        expert_dispatch="alltoall",
        replicas=decode_replicas,
    )
    return config


def test_tp_prefill_to_ep_decode_equals_the_single_process_engine(
    moe_model_dir, moe_reference, tmp_path
):
    served = start_cluster(_config(moe_model_dir), tmp_path)
    try:
        stub = served.stub()
        for i, prompt in enumerate([*PROMPTS, TOKEN_PROMPT]):
            disagg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_ALWAYS))
            agg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_NEVER))
            assert disagg[0] == agg[0] == moe_reference[i], f"prompt {i}"
        wait_blocks_released(stub)
        # Expert load in the status: every MoE layer of a worker saw the same pairs (each
        # token passes every layer), and the EP decode replica's rank 0 counts all of them.
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        for pool in status.pools:
            (worker,) = pool.workers
            sums = {sum(load.tokens) for load in worker.expert_load}
            assert len(worker.expert_load) > 0 and len(sums) == 1 and sums.pop() > 0, pool.role
    finally:
        assert stop_cluster(served) == 0


@pytest.fixture(scope="module")
def moe_stream_reference(moe_model_dir) -> list[list[int]]:
    from workers import LLM, SamplingParams

    llm = LLM(str(moe_model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(STREAMS, params)]


@pytest.mark.slow  # two expert-parallel replicas, a kill, a restart: about a minute
def test_a_dead_expert_parallel_rank_migrates_its_streams_and_is_restarted(
    moe_model_dir, moe_reference, moe_stream_reference, tmp_path
):
    # A gloo collective whose peer died fails at once (its connection closes), so the
    # other rank's all-to-all does not hang; the replica leaves routing and its streams
    # migrate as for any dead rank (tests/e2e/test_parallel_cluster.py).
    config = _config(moe_model_dir, decode_replicas=2)
    config["prefill"]["tensor_parallel"] = 1  # the decode replicas' ranks 1: the only followers
    config["router"]["policy"] = "round_robin"
    served = start_cluster(config, tmp_path)
    try:
        assert_dead_decode_rank_migrates(served, moe_reference, moe_stream_reference)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
