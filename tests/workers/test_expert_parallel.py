"""Expert parallelism's dispatch and combine (workers/models/expert_parallel.py) across real
gloo processes: with the experts split over 2 ranks, both dispatchers give every rank the
same layer output as one rank holding every expert (float32, up to summation order), on
ragged token counts, with a rank that receives no pair, and with fewer tokens than ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.moe import fused_moe, select_experts
from workers.models.expert_parallel import (
    AllReduceDispatch,
    AllToAllDispatch,
    ExpertPlacement,
    LocalDispatch,
    make_dispatcher,
)
from workers.parallel.replica import free_port

NUM_EXPERTS, HIDDEN, INTER = 8, 24, 20
CASES = (  # (num_tokens, top_k, skew): skew routes every token to rank 0's experts
    (7, 2, False),
    (33, 2, False),
    (1, 2, False),  # fewer tokens than ranks: rank 1's slice is empty
    (9, 1, True),  # rank 1 holds experts nobody picked
)


def _layer(num_tokens: int, top_k: int, skew: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    if skew:
        logits[:, NUM_EXPERTS // 2 :] -= 100.0
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return hidden, w13, w2, weights, ids


def _rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        placement = ExpertPlacement(NUM_EXPERTS, rank, world)
        lo, hi = placement.first_expert, placement.first_expert + placement.num_local_experts
        for case in CASES:
            hidden, w13, w2, weights, ids = _layer(*case)
            whole = fused_moe(hidden, w13, w2, weights, ids)

            def experts(x, w, i, lo=lo, hi=hi, w13=w13, w2=w2):
                return fused_moe(x, w13[lo:hi], w2[lo:hi], w, i, first_expert=lo)

            for dispatcher in (AllReduceDispatch(), AllToAllDispatch(placement)):
                out = dispatcher(hidden, weights, ids, experts)
                err = (out - whole).abs().max().item() if len(out) else 0.0
                results.put((rank, case, type(dispatcher).__name__, tuple(out.shape), err))
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_rank_with_both_dispatchers():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(100)
    assert [proc.exitcode for proc in procs] == [0, 0]
    rows = [results.get(timeout=5) for _ in range(2 * len(CASES) * 2)]
    assert {(rank, name) for rank, _, name, _, _ in rows} == {
        (r, n) for r in (0, 1) for n in ("AllReduceDispatch", "AllToAllDispatch")
    }
    for rank, (num_tokens, _, _), name, shape, err in rows:
        assert shape == (num_tokens, HIDDEN), (rank, name)
        assert err < 1e-5, (rank, num_tokens, name, err)


def test_placement_splits_experts_and_refuses_what_does_not_divide():
    placement = ExpertPlacement(8, ep_rank=1, ep_size=4)
    assert (placement.first_expert, placement.num_local_experts) == (2, 2)
    assert placement.owner(torch.tensor([0, 1, 2, 7])).tolist() == [0, 0, 1, 3]
    with pytest.raises(ValueError, match="expert_parallel 3 does not divide the model's 8"):
        ExpertPlacement(8, 0, 3)
    with pytest.raises(ValueError, match="bad expert-parallel rank"):
        ExpertPlacement(8, 2, 2)


def test_one_rank_is_the_local_computation_and_kinds_are_checked():
    hidden, w13, w2, weights, ids = _layer(5, 2, False)
    dispatcher = make_dispatcher(ExpertPlacement(NUM_EXPERTS), "alltoall")
    assert isinstance(dispatcher, LocalDispatch)
    out = dispatcher(hidden, weights, ids, lambda x, w, i: fused_moe(x, w13, w2, w, i))
    assert torch.equal(out, fused_moe(hidden, w13, w2, weights, ids))
    with pytest.raises(ValueError, match="expert dispatch 'nccl-magic': choose one of"):
        make_dispatcher(ExpertPlacement(NUM_EXPERTS), "nccl-magic")


# ---- the engine with its experts split over two ranks ---------------------------------------


def _ep_rank_main(rank: int, world: int, port: int, model_dir: str, out: str, kind: str) -> None:
    """tests/workers/test_tensor_parallel.py's replica rank, its engine config with the
    experts sharded over the ranks (``kind`` dispatch)."""
    import dataclasses

    from tests.workers import test_tensor_parallel

    plain = test_tensor_parallel._config
    test_tensor_parallel._config = lambda path: dataclasses.replace(
        plain(path), expert_parallel=world, expert_dispatch=kind
    )
    # Count the dispatcher's calls: the tokens alone would also match with the experts
    # split the TP way (the flag ignored).
    cls = {"allreduce": AllReduceDispatch, "alltoall": AllToAllDispatch}[kind]
    calls, call = [0], cls.__call__

    def counted(self, *args):
        calls[0] += 1
        return call(self, *args)

    cls.__call__ = counted
    test_tensor_parallel._rank_main(rank, world, port, model_dir, out)
    Path(out, f"dispatch{rank}.json").write_text(str(calls[0]))


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2) and the single-process engine's greedy tokens."""
    from cluster.tools.make_model import make_model
    from tests.workers import test_tensor_parallel
    from workers.engine.llm_engine import LLMEngine

    path = str(make_model(tmp_path_factory.mktemp("ep") / "tiny", "qwen3-moe", "tiny"))
    return path, test_tensor_parallel._generate(LLMEngine(test_tensor_parallel._config(path)))


@pytest.mark.parametrize("kind", ["allreduce", "alltoall"])
def test_expert_parallel_engine_equals_the_single_process_engine(moe_model, kind, tmp_path):
    import json

    model_dir, want = moe_model
    mp.start_processes(
        _ep_rank_main,
        args=(2, free_port("127.0.0.1"), model_dir, str(tmp_path), kind),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["tokens"] == want
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert follower["steps"] == got["steps"]  # the follower ran every step, in lockstep
    dispatched = [int((tmp_path / f"dispatch{r}.json").read_text()) for r in (0, 1)]
    assert dispatched[0] == dispatched[1] >= got["steps"]  # each MoE layer, every step


def test_a_rank_holds_whole_experts_of_its_share(moe_model):
    from kernels import REFERENCE_OPS
    from workers.models.arch_config import ArchConfig
    from workers.models.moe import SparseMoeBlock
    from workers.models.parallel import ParallelContext

    config = ArchConfig.from_model_dir(moe_model[0])
    rank1 = ParallelContext(tp_rank=1, tp_size=2, expert_parallel=True)
    block = SparseMoeBlock(config, rank1, REFERENCE_OPS)
    half = config.num_experts // 2
    assert block.experts.first_expert == half
    assert block.experts.w13.shape == (half, 2 * config.moe_intermediate_size, config.hidden_size)
    assert isinstance(block.dispatch, AllReduceDispatch)
    split = SparseMoeBlock(config, ParallelContext(tp_rank=1, tp_size=2), REFERENCE_OPS)
    assert split.dispatch is None  # plain TP: every expert, half its intermediate dimension
    assert split.experts.w13.shape[:2] == (config.num_experts, config.moe_intermediate_size)


def test_expert_parallel_is_refused_where_it_cannot_hold(tmp_path):
    from cluster.tools.make_model import make_model
    from workers.engine.config import EngineConfig, check_expert_parallel
    from workers.models.loader import load_model
    from workers.models.parallel import ParallelContext

    dense = make_model(tmp_path / "dense", "llama", "tiny")
    with pytest.raises(ValueError, match="expert_parallel: LlamaForCausalLM has no experts"):
        load_model(dense, torch.float32, "cpu", parallel=ParallelContext(expert_parallel=True))
    with pytest.raises(ValueError, match=r"must be 1 \(off\) or the replica's tensor_parallel"):
        check_expert_parallel(EngineConfig(model=str(dense), expert_parallel=4), 2)
    with pytest.raises(ValueError, match="expert_dispatch: must be one of allreduce, alltoall"):
        EngineConfig(model=str(dense), expert_dispatch="carrier-pigeon")
