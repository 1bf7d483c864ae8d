"""Expert parallelism: a replica's experts sharded over its ranks, and how tokens reach them.

Design (docs/moe.md): the ranks of a replica that share its experts are its tensor-parallel
ranks. Attention stays tensor-parallel, so after every attention block each rank holds
*every* token's hidden state (the row-parallel all-reduce put it there); the MoE layer then
needs each token's top-k experts, which live on ``ep_size`` ranks, ``E / ep_size`` consecutive
experts each (``ExpertPlacement``). Two ways to get the tokens to their experts and the
results back, behind one call (``ExpertDispatcher``):

- ``AllReduceDispatch`` ("all-gather / reduce-scatter" in the literature, which is what it
  is when the tokens already sit on every rank): each rank runs its own experts over all the
  tokens routed to them, and one all-reduce sums the partial outputs. It moves
  ``num_tokens x hidden`` per rank whatever the routing, and no rank waits on a count.
- ``AllToAllDispatch``: each rank takes a slice of the tokens (``num_tokens / ep_size``,
  uneven when it does not divide), sends each (token, expert) pair's row to the expert's
  rank with ``all_to_all_single`` and uneven splits, gets the weighted expert outputs back
  the same way, sums each token's k pairs, and an all-gather rebuilds every token on every
  rank. It moves ``num_tokens x top_k / ep_size`` rows each way per rank, less than the
  all-reduce once ``top_k < ep_size``; what vLLM, SGLang (DeepEP) and TensorRT-LLM use at
  scale.

Both compute each pair with the same expert weights; they differ from one rank (and from each
other) only in the order float32 sums are taken, so greedy tokens match (tested with real
gloo process groups: tests/workers/test_expert_parallel.py).

**Data-parallel inputs** (``attention: data_parallel``, workers/parallel/dp_group.py): each rank
of the group is its own engine with its own requests, so a rank holds only *its* tokens, a
different number on each rank (zero on an idle one), and wants back only their outputs. Two
dispatchers take such inputs, chosen by the same ``expert_dispatch``:

- ``DataParallelGather`` ("allreduce"): every rank's rows all-gathered, padded to the step's
  largest count (``DpStepTokens``: the counts every rank learned before the forward), each
  rank's experts over all of them, and a reduce-scatter hands each rank the sum for its own
  rows. Moves ``ranks x max_tokens x hidden`` per rank each way.
- ``DataParallelAllToAll`` ("alltoall"): ``AllToAllDispatch`` with each rank's own tokens as
  its slice and no all-gather at the end (nobody needs the others' tokens).

``experts(hidden, topk_weights, topk_ids)`` is the caller's local computation (the model's
``ops.fused_moe`` over this rank's experts, with its ``first_expert``): given rows and their
pairs, the weighted sum over the pairs held here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

# (hidden [R, H], topk_weights float32 [R, k], topk_ids int64 [R, k]) -> [R, H]: the weighted
# sum over each row's pairs held on this rank (others contribute nothing).
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts a rank holds: ``num_experts / ep_size`` consecutive ones per rank."""

    num_experts: int
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"bad expert-parallel rank {self.ep_rank} of {self.ep_size}")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"expert_parallel {self.ep_size} does not divide the model's "
                f"{self.num_experts} experts"
            )

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def owner(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """The rank holding each of ``expert_ids`` (same shape)."""
        return torch.div(expert_ids, self.num_local_experts, rounding_mode="floor")


class DpStepTokens:
    """The tokens each rank of a data-parallel group runs in the current forward, rank order.

    Set by the group's lockstep (``DpLockstep.sync``, workers/parallel/dp_group.py) before
    every forward, real or empty, and read by ``DataParallelGather``; one object per rank,
    handed to the layers through ``ParallelContext.dp_tokens`` (no module-level state)."""

    def __init__(self, dp_size: int) -> None:
        self.num_tokens: tuple[int, ...] = (0,) * dp_size

    @property
    def max_tokens(self) -> int:
        return max(self.num_tokens)


class ExpertDispatcher(Protocol):
    """Runs a MoE layer's experts for tokens that every rank of the group holds.

    Called by every rank of the group with the same ``hidden``, ``topk_weights`` and
    ``topk_ids`` (all tokens, global expert ids); returns every token's full output (the
    sum over all its top-k experts, wherever they live) on every rank. Mutates nothing.
    The data-parallel ones take each rank's *own* tokens instead and return their outputs.
    """

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: LocalExperts,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LocalDispatch:
    """One rank holds every expert: the local computation is the whole layer."""

    def __call__(self, hidden, topk_weights, topk_ids, experts):
        return experts(hidden, topk_weights, topk_ids)


@dataclass(frozen=True)
class AllReduceDispatch:
    """Every rank computes its experts' share for all tokens; one all-reduce sums them."""

    group: dist.ProcessGroup | None = None

    def __call__(self, hidden, topk_weights, topk_ids, experts):
        out = experts(hidden, topk_weights, topk_ids)
        dist.all_reduce(out, group=self.group)
        return out


@dataclass(frozen=True)
class AllToAllDispatch:
    """Token slices sent to the experts' ranks and back with uneven ``all_to_all_single``."""

    placement: ExpertPlacement
    group: dist.ProcessGroup | None = None

    def __call__(self, hidden, topk_weights, topk_ids, experts):
        num_tokens = hidden.shape[0]
        ep_size, rank = self.placement.ep_size, self.placement.ep_rank
        # This rank's slice of the tokens: the first ``num_tokens % ep_size`` ranks one more.
        sizes = [num_tokens // ep_size + (r < num_tokens % ep_size) for r in range(ep_size)]
        start = sum(sizes[:rank])
        mine = slice(start, start + sizes[rank])
        local = _exchange(
            self.placement, self.group, hidden[mine], topk_weights[mine], topk_ids[mine], experts
        )
        return _all_gather_rows(local, sizes, self.group)


@dataclass(frozen=True)
class DataParallelAllToAll:
    """Data-parallel inputs: each rank's own tokens to the experts' ranks and back, uneven
    ``all_to_all_single`` both ways; no gather (each rank keeps only its rows)."""

    placement: ExpertPlacement
    group: dist.ProcessGroup | None = None

    def __call__(self, hidden, topk_weights, topk_ids, experts):
        return _exchange(self.placement, self.group, hidden, topk_weights, topk_ids, experts)


@dataclass(frozen=True)
class DataParallelGather:
    """Data-parallel inputs: all ranks' rows gathered (padded to the step's largest count),
    this rank's experts over all of them, and a reduce-scatter back to their owners."""

    placement: ExpertPlacement
    tokens: DpStepTokens
    group: dist.ProcessGroup | None = None

    def __call__(self, hidden, topk_weights, topk_ids, experts):
        counts, rank = self.tokens.num_tokens, self.placement.ep_rank
        num_tokens, hidden_size = hidden.shape
        if num_tokens != counts[rank]:
            raise RuntimeError(
                f"data-parallel rank {rank}: {num_tokens} tokens in the MoE layer, "
                f"{counts[rank]} agreed for the step"
            )
        width, top_k = max(counts), topk_ids.shape[1]
        rows = hidden.new_zeros(width, hidden_size)
        rows[:num_tokens] = hidden
        # Each row's expert ids and weights beside it (ids as float64: exact below 2**53).
        meta = torch.zeros(width, 2 * top_k, dtype=torch.float64, device=hidden.device)
        meta[:num_tokens, :top_k] = topk_ids.double()
        meta[:num_tokens, top_k:] = topk_weights.double()
        all_rows = hidden.new_empty(len(counts) * width, hidden_size)
        all_meta = meta.new_empty(len(counts) * width, 2 * top_k)
        dist.all_gather_single(all_rows, rows, group=self.group)
        dist.all_gather_single(all_meta, meta, group=self.group)
        # Only the real rows go through the experts (the padding would cost expert work).
        real = torch.cat(
            [torch.arange(r * width, r * width + n, device=hidden.device) for r, n in
             enumerate(counts)]
        )  # fmt: skip
        pairs = all_meta[real]
        done = experts(all_rows[real], pairs[:, top_k:].float(), pairs[:, :top_k].long())
        partial = hidden.new_zeros(len(counts) * width, hidden_size)
        partial[real] = done
        out = hidden.new_empty(width, hidden_size)
        dist.reduce_scatter_single(out, partial, group=self.group)
        return out[:num_tokens]


def _exchange(
    placement: ExpertPlacement,
    group: dist.ProcessGroup | None,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: LocalExperts,
) -> torch.Tensor:
    """``hidden``'s rows (this rank's, any number) through their experts on whichever ranks
    hold them and back: each (row, expert) pair's row sent to the expert's rank with uneven
    ``all_to_all_single`` (the counts first), the weighted results returned the same way
    and each row's k pairs summed in slot order (float32). Returns [rows, H]."""
    num_rows, hidden_size = hidden.shape
    ep_size, top_k = placement.ep_size, topk_ids.shape[1]
    ids = topk_ids.flatten()  # [P] the pairs, row-major
    weights = topk_weights.flatten()
    # Pairs grouped by the rank that holds their expert (stable: row order kept).
    order = torch.argsort(placement.owner(ids), stable=True)
    send_counts = torch.bincount(placement.owner(ids), minlength=ep_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    num_recv = sum(recv_splits)
    rows = hidden[order // top_k]  # [P, H] one row per pair
    recv_rows = hidden.new_empty(num_recv, hidden_size)
    dist.all_to_all_single(recv_rows, rows, recv_splits, send_splits, group=group)
    # Each pair's expert id and weight travel beside its row (ids as float64: exact below
    # 2**53, and one message instead of two).
    meta = torch.stack([ids[order].double(), weights[order].double()], dim=1)
    recv_meta = meta.new_empty(num_recv, 2)
    dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits, group=group)
    pair_ids = recv_meta[:, 0].long()[:, None]  # [R, 1]
    pair_weights = recv_meta[:, 1].float()[:, None]
    done = experts(recv_rows, pair_weights, pair_ids)  # [R, H] each pair weighted
    back = hidden.new_empty(len(order), hidden_size)
    dist.all_to_all_single(back, done, send_splits, recv_splits, group=group)
    pair_out = torch.empty(len(order), hidden_size, dtype=torch.float32, device=hidden.device)
    pair_out[order] = back.float()
    return pair_out.view(num_rows, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


def _all_gather_rows(
    local: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every rank's ``local`` rows (``sizes[r]`` of them on rank ``r``) concatenated."""
    width = max(sizes)
    padded = local.new_zeros(width, local.shape[1])
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


DISPATCH_KINDS = ("allreduce", "alltoall")


def make_dispatcher(
    placement: ExpertPlacement,
    kind: str = "allreduce",
    group: dist.ProcessGroup | None = None,
    dp_tokens: DpStepTokens | None = None,
) -> ExpertDispatcher:
    """The dispatcher for ``placement``: local at ``ep_size == 1``; else ``kind``, for
    data-parallel inputs (each rank its own tokens) when ``dp_tokens`` is given."""
    if kind not in DISPATCH_KINDS:
        raise ValueError(f"expert dispatch {kind!r}: choose one of {', '.join(DISPATCH_KINDS)}")
    if placement.ep_size == 1:
        return LocalDispatch()
    if dp_tokens is not None:
        if kind == "alltoall":
            return DataParallelAllToAll(placement, group)
        return DataParallelGather(placement, dp_tokens, group)
    if kind == "alltoall":
        return AllToAllDispatch(placement, group)
    return AllReduceDispatch(group)
