"""The rebalancer's pure parts, on CPU without processes: the placement policy
(workers/models/eplb_policy.py), the logical -> physical map and the slot layout a MoE layer
gets (workers/models/expert_rebalance.py), and the refusals of impossible settings."""

from __future__ import annotations

import pytest
import torch

from workers.models.eplb_policy import EMPTY, home_plan, max_over_mean, plan_layer
from workers.models.expert_rebalance import ExpertMap

SKEWED = [100, 50, 10, 10, 5, 5, 5, 5]  # rank 0 of 2 holds experts 0-3: 170 against 20


def test_a_skewed_layer_gets_its_hot_experts_copied_to_the_cold_rank():
    assert max_over_mean(home_plan(8, 2, 2).rank_loads(SKEWED)) == pytest.approx(170 / 95)
    plan = plan_layer(SKEWED, ep_size=2, num_redundant=2)
    assert plan.spares == ((EMPTY, EMPTY), (0, 1))
    assert plan.holders(0) == (0, 1) and plan.holders(4) == (1,)
    # rank 0: 100/2 + 50/2 + 10 + 10; rank 1: 100/2 + 50/2 + 4 * 5
    assert plan.rank_loads(SKEWED) == [95.0, 95.0]


def test_one_hot_expert_is_spread_over_every_rank_and_no_further():
    load = [120] + [0] * 11
    plan = plan_layer(load, ep_size=4, num_redundant=3)
    assert plan.spares == ((EMPTY,) * 3, (0, EMPTY, EMPTY), (0, EMPTY, EMPTY), (0, EMPTY, EMPTY))
    assert plan.rank_loads(load) == [30.0] * 4


def test_a_balanced_or_idle_layer_is_left_alone():
    for load in ([10] * 8, [0] * 8, [7, 3, 6, 4, 5, 5, 2, 8]):  # ranks 20 and 20
        assert plan_layer(load, 2, 2).spares == ((EMPTY, EMPTY), (EMPTY, EMPTY)), load


def test_the_plan_never_worsens_the_busiest_rank_and_respects_the_slots():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        ep_size = (2, 4)[trial % 2]
        num_experts = ep_size * int(torch.randint(1, 5, (1,), generator=gen))
        load = (torch.rand(num_experts, generator=gen) ** 4 * 1000).round().tolist()
        num_redundant = int(torch.randint(0, num_experts - num_experts // ep_size + 1, (1,),
                                          generator=gen))  # fmt: skip
        plan = plan_layer(load, ep_size, num_redundant)
        assert plan == plan_layer(load, ep_size, num_redundant)  # deterministic
        before = max(home_plan(num_experts, ep_size, num_redundant).rank_loads(load))
        assert max(plan.rank_loads(load)) <= before + 1e-9
        for rank, slots in enumerate(plan.spares):
            assert len(slots) == num_redundant
            copied = [e for e in slots if e != EMPTY]
            assert len(set(copied)) == len(copied)  # one copy of an expert per rank
            assert all(plan.home_rank(e) != rank for e in copied)


def test_more_spares_than_other_experts_is_refused():
    with pytest.raises(ValueError, match=r"at most 6 \(the experts a rank does not hold"):
        plan_layer([1] * 8, ep_size=4, num_redundant=7)


def test_the_map_alternates_a_copied_experts_tokens_over_its_copies():
    expert_map = ExpertMap(num_experts=8, ep_size=2, num_redundant=2)  # 6 slots per rank
    ids = torch.tensor([[0, 4], [0, 1], [0, 5], [1, 0]])
    assert torch.equal(expert_map.physical(ids), torch.tensor([[0, 6], [0, 1], [0, 7], [1, 0]]))
    expert_map.switch(plan_layer(SKEWED, 2, 2))  # rank 1's spares: slots 10 and 11
    assert expert_map.replica_slots[:2].tolist() == [[0, 10], [1, 11]]
    assert expert_map.num_copies.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    # token n (4 mapped before) takes copy n % 2 of experts 0 and 1; expert 4 is at slot 6
    assert expert_map.physical(ids).tolist() == [[0, 6], [10, 11], [0, 7], [11, 10]]
    assert expert_map.rank_tokens() == [6 + 2, 2 + 6]  # both calls' pairs, by rank
    one = torch.tensor([[1, 0]])  # one token a step still alternates, step by step
    assert [expert_map.physical(one).tolist() for _ in range(3)] == [[[1, 0]], [[11, 10]]] * 1 + [
        [[1, 0]]
    ]


def test_a_rank_holds_its_home_experts_then_zeroed_spares(tmp_path):
    from cluster.tools.make_model import make_model
    from kernels import REFERENCE_OPS
    from workers.models.arch_config import ArchConfig
    from workers.models.expert_parallel import AllToAllDispatch
    from workers.models.moe import SparseMoeBlock
    from workers.models.parallel import ParallelContext

    config = ArchConfig.from_model_dir(make_model(tmp_path / "m", "qwen3-moe", "tiny"))
    rank1 = ParallelContext(
        tp_rank=1, tp_size=2, expert_parallel=True, expert_dispatch="alltoall", expert_redundant=3
    )
    block = SparseMoeBlock(config, rank1, REFERENCE_OPS)
    assert block.experts.w13.shape[0] == 4 + 3 and block.experts.first_expert == 4
    assert block.experts.w13[4:].abs().sum() == 0
    assert block.first_slot == 7  # rank 1's slots are physical 7..13
    assert isinstance(block.dispatch, AllToAllDispatch)
    assert block.dispatch.placement.num_experts == 14
    with pytest.raises(ValueError, match="expert_redundant: 5 spare slots per rank, but with"):
        SparseMoeBlock(config, ParallelContext(1, 2, expert_parallel=True, expert_redundant=5),
                       REFERENCE_OPS)  # fmt: skip


def test_rebalancing_without_expert_parallelism_is_refused():
    from cluster.config import ConfigError, parse_config
    from workers.engine.config import EngineConfig

    with pytest.raises(ValueError, match="expert_rebalance_steps: needs expert_parallel > 1"):
        EngineConfig(model="m", expert_rebalance_steps=8)
    with pytest.raises(ConfigError, match=r"decode\.expert_rebalance_steps: needs decode\.expert_"):
        parse_config({"decode": {"expert_rebalance_steps": 8}})


def test_more_spares_than_a_rank_can_fill_is_refused_at_bring_up():
    from cluster.config import PoolSection
    from cluster.parallel_check import check_pool_parallel
    from tests.cluster.test_parallel_check import MOE  # 8 experts

    def pool(redundant: int) -> PoolSection:
        return PoolSection(tensor_parallel=2, expert_parallel=2, expert_rebalance_steps=8,
                           expert_redundant=redundant)  # fmt: skip

    check_pool_parallel("decode", pool(4), MOE, "cpu", [])
    with pytest.raises(ValueError, match=r"decode\.expert_redundant: 5 spare .* at most the 4"):
        check_pool_parallel("decode", pool(5), MOE, "cpu", [])
