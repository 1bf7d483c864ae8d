"""Bring-up's checks of a pool's parallel layout against the model and the cluster."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import PoolSection
from cluster.config_schema import replaced
from cluster.parallel_check import check_pool_parallel
from tests.workers.test_models_config import LLAMA31_V4
from workers.models.arch_config import ArchConfig

# Llama-3-8B's shape: 32 heads, 8 KV heads, intermediate 14336 (the config.json that the
# model-config tests read).
ARCH = ArchConfig.from_dict(LLAMA31_V4)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
def test_layouts_that_split_the_model_pass(tp):
    pool = PoolSection(tensor_parallel=tp)
    check_pool_parallel("decode", pool, ARCH, "cpu", [])  # raises ValueError if refused
    # On GPUs the stage's ranks need one node: a node of tp GPUs fits, one GPU less does not
    # (so the pass above is the layout check's decision, not a check that never refuses).
    check_pool_parallel("decode", pool, ARCH, "cuda", [tp])
    with pytest.raises(ValueError, match=rf"decode.tensor_parallel: .* {tp} ranks .* has {tp - 1}"):
        check_pool_parallel("decode", pool, ARCH, "cuda", [tp - 1])


@pytest.mark.parametrize(
    ("tp", "pp", "node_gpus"),
    [
        (1, 2, [2]),
        (2, 2, [4]),
        (1, 32, []),
        (4, 3, []),
        # Stages span nodes: each stage's TP ranks on one node.
        (4, 2, [4, 4]),
        (2, 3, [4, 2, 1]),
        (8, 4, [8, 8, 8, 8]),
    ],
)
def test_pipeline_stages_pass_up_to_one_per_layer_and_one_node_per_stage(tp, pp, node_gpus):
    pool = PoolSection(tensor_parallel=tp, pipeline_parallel=pp)
    device = "cuda" if node_gpus else "cpu"
    check_pool_parallel("decode", pool, ARCH, device, node_gpus)  # raises ValueError if refused
    # Where a bound is reached (every node's GPUs used, or a stage per layer), one more stage
    # is refused: the pass above is the check's decision, not a check that never refuses.
    if node_gpus or pp == ARCH.num_hidden_layers:
        one_more = replaced(pool, pipeline_parallel=pp + 1)
        with pytest.raises(ValueError, match="pipeline_parallel"):
            check_pool_parallel("decode", one_more, ARCH, device, node_gpus)


@pytest.mark.parametrize(
    "pool, arch, device, gpus, message",
    [
        (PoolSection(tensor_parallel=3), ARCH, "cpu", [], "3 does not divide .*attention_heads"),
        (
            PoolSection(tensor_parallel=4),
            dataclasses.replace(ARCH, num_key_value_heads=6, num_attention_heads=48),
            "cpu",
            [],
            "num_key_value_heads \\(6\\) must divide one another",
        ),
        (
            PoolSection(tensor_parallel=2),
            dataclasses.replace(ARCH, intermediate_size=14337),
            "cpu",
            [],
            "intermediate_size",
        ),
        (PoolSection(tensor_parallel=8), ARCH, "cuda", [4, 4], "largest node has 4 GPUs"),
        (
            PoolSection(pipeline_parallel=33),
            ARCH,
            "cpu",
            [],
            "pipeline_parallel: 33 stages, but the model has only 32 layers",
        ),
        (
            PoolSection(tensor_parallel=2, pipeline_parallel=4),
            ARCH,
            "cuda",
            [4, 3],
            "tensor_parallel x pipeline_parallel: a replica's 4 stages of 2 GPUs .* "
            "\\(4, 3 GPUs: room for 3\\)",
        ),
        (
            PoolSection(tensor_parallel=3, pipeline_parallel=2),
            ARCH,
            "cpu",
            [],
            "tensor_parallel: 3 does not divide",
        ),
    ],
)
def test_layouts_that_cannot_work_are_refused_with_the_key(pool, arch, device, gpus, message):
    with pytest.raises(ValueError, match=message) as info:
        check_pool_parallel("prefill", pool, arch, device, gpus)
    assert str(info.value).startswith("prefill.")


MOE = dataclasses.replace(
    ARCH,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=1408,
    architecture="Qwen3MoeForCausalLM",
)


def test_moe_layouts_are_checked_against_the_experts():
    check_pool_parallel("decode", PoolSection(tensor_parallel=2), MOE, "cpu", [])
    check_pool_parallel("decode", PoolSection(tensor_parallel=8, expert_parallel=8), MOE, "cpu", [])
    odd = dataclasses.replace(MOE, moe_intermediate_size=1407)
    with pytest.raises(ValueError, match=r"tensor_parallel: 2 does not divide .* moe_inter"):
        check_pool_parallel("decode", PoolSection(tensor_parallel=2), odd, "cpu", [])
    # whole experts per rank: the intermediate size need not split, the experts must
    check_pool_parallel("decode", PoolSection(tensor_parallel=2, expert_parallel=2), odd, "cpu", [])
    six = dataclasses.replace(MOE, num_experts=6)
    with pytest.raises(ValueError, match=r"decode.expert_parallel: 4 does not divide .* 6 experts"):
        check_pool_parallel(
            "decode", PoolSection(tensor_parallel=4, expert_parallel=4), six, "cpu", []
        )
    with pytest.raises(
        ValueError, match=r"decode\.expert_parallel: LlamaForCausalLM has no experts"
    ):
        check_pool_parallel(
            "decode", PoolSection(tensor_parallel=2, expert_parallel=2), ARCH, "cpu", []
        )
