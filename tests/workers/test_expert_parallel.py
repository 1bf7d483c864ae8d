"""Expert parallelism's dispatch and combine (workers/models/expert_parallel.py) across real
gloo processes: with the experts split over 2 ranks, both dispatchers give every rank the
same layer output as one rank holding every expert (float32, up to summation order), on
ragged token counts, with a rank that receives no pair, and with fewer tokens than ranks.
"""

from __future__ import annotations

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
