"""MoE expert load (docs/moe.md, "Expert load"): each MoE layer counts the (token, slot)
pairs its router sends to each expert; the worker's report carries the totals, its
Prometheus counters add what is new, and the router's status shows them."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from workers.protocol.wire import ExpertLoad, WorkerReport
from workers.serving.metrics import WorkerMetrics


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("load") / "tiny", "qwen3-moe", "tiny")


def test_every_moe_layer_counts_top_k_pairs_per_token_it_computes(moe_dir):
    from workers import LLM, SamplingParams
    from workers.models.arch_config import ArchConfig
    from workers.models.moe import expert_load

    arch = ArchConfig.from_model_dir(moe_dir)
    llm = LLM(str(moe_dir), dtype="float32", max_model_len=256, enable_prefix_caching=False)
    assert expert_load(llm.engine.model) == tuple(
        (layer, (0,) * arch.num_experts)
        for layer in range(arch.num_hidden_layers)
        if arch.is_moe_layer(layer)
    )
    prompts = [[5 + i + j for j in range(n)] for i, n in enumerate((3, 17, 9))]
    new = 6
    llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    load = expert_load(llm.engine.model)
    # every token the model computed went through every MoE layer: the prompt and every
    # generated token but the last (sampled, never fed back)
    forwarded = sum(len(p) + new - 1 for p in prompts)
    assert {sum(tokens) for _, tokens in load} == {arch.num_experts_per_tok * forwarded}
    assert all(len(tokens) == arch.num_experts for _, tokens in load)
    assert any(len(set(tokens)) > 1 for _, tokens in load)  # routing, not a round robin


def _report(load: tuple[ExpertLoad, ...]) -> WorkerReport:
    return WorkerReport(
        name="decode-moe", role="decode", healthy=True, num_running=0, num_waiting=0,
        kv_blocks_total=8, kv_blocks_used=0, kv_blocks_cached=0, num_held=0, expert_load=load,
    )  # fmt: skip


def _sample(name: str, **labels) -> float | None:
    base = {"role": "decode", "model": "tiny", "instance": "decode-moe"}
    return REGISTRY.get_sample_value(name, {**base, **labels})


def test_reports_move_the_expert_counters_by_what_is_new_and_set_the_imbalance():
    metrics = WorkerMetrics("decode", "tiny", "decode-moe")
    metrics.report(_report((ExpertLoad(1, (3, 1, 0, 4)),)))
    metrics.report(_report((ExpertLoad(1, (5, 1, 2, 4)),)))
    counts = [_sample("baton_moe_expert_tokens_total", layer="1", expert=str(e)) for e in range(4)]
    assert counts == [5.0, 1.0, 2.0, 4.0]
    assert _sample("baton_moe_expert_load_max_over_mean", layer="1") == pytest.approx(5 / 3)
    # the report round-trips the wire (msgpack, as the event channel sends it)
    report = _report((ExpertLoad(3, (7, 0)),))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=WorkerReport)
    assert decoded.expert_load == (ExpertLoad(3, (7, 0)),)


def test_the_status_message_carries_each_layers_load():
    from router.server import cluster_status_message
    from router.status import ClusterStatus, ExpertLoadStatus, PoolStatus, WorkerStatus

    worker = WorkerStatus(
        name="decode-0", role="decode", healthy=True, state="serving", restarts=0,
        tensor_parallel=2, pipeline_parallel=1, num_running=0, num_waiting=0, num_incoming=0,
        kv_blocks_total=8, kv_blocks_used=0, kv_blocks_cached=0, spec_num_steps=0,
        spec_num_draft_tokens=0, spec_num_accepted_tokens=0,
        expert_load=(ExpertLoadStatus(0, (4, 0, 2, 2)), ExpertLoadStatus(1, (1, 1, 3, 3))),
    )  # fmt: skip
    status = ClusterStatus("tiny", (PoolStatus("decode", 1, 1, (worker,)),), "nixl",
                           "kv_aware", "always", False, "")  # fmt: skip
    message = cluster_status_message(status)
    loads = message.pools[0].workers[0].expert_load
    assert [(e.layer, list(e.tokens)) for e in loads] == [(0, [4, 0, 2, 2]), (1, [1, 1, 3, 3])]


def test_baton_status_shows_the_most_and_least_skewed_layer():
    from cluster.client import format_status
    from proto.baton.v1 import inference_pb2 as pb

    worker = pb.WorkerStatus(
        name="decode-0", role="decode", healthy=True, state="serving",
        expert_load=[pb.ExpertLoad(layer=0, tokens=[4, 0, 2, 2]),
                     pb.ExpertLoad(layer=1, tokens=[2, 2, 2, 2])],
    )  # fmt: skip
    dense = pb.WorkerStatus(name="prefill-0", role="prefill", healthy=True, state="serving")
    status = pb.ClusterStatus(
        model="tiny",
        pools=[pb.PoolStatus(role="prefill", replicas=1, healthy_replicas=1, workers=[dense]),
               pb.PoolStatus(role="decode", replicas=1, healthy_replicas=1, workers=[worker])],
    )  # fmt: skip
    text = format_status(status)
    assert text.count("MoE expert load:") == 1  # the dense pool has no table
    table = text.split("MoE expert load:")[1]
    row = next(line for line in table.splitlines() if line.strip().startswith("decode-0"))
    assert row.split()[1:] == ["2", "8", "2.00", "(layer", "0)", "1.00", "(layer", "1)"]
