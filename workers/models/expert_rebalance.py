"""The expert placement rebalancer: redundant copies of hot experts, swapped in while serving.

Slots. With ``expert_parallel: N`` and ``expert_redundant: R`` each rank holds ``S = E / N
+ R`` physical expert slots: its ``E / N`` home experts (never moved) and ``R`` spares
(``workers/models/eplb_policy.py`` decides what they hold). Physical slot ``r * S + j`` is
rank ``r``'s ``j``-th, so the dispatchers (``expert_parallel.py``) run unchanged over
``N * S`` "experts", ``S`` consecutive per rank: only the ids they get change.

The map (``ExpertMap``, one per MoE layer): logical expert -> its copies' physical slots,
home first. A token's pair for expert ``e`` goes to copy ``n % copies(e)``, ``n`` the
token's number counted over the layer's forwards: a deterministic spread (also of one
decode token a step), so every rank maps alike with no message, and every copy holds the
same weights, so the output changes only by float32 summation order across ranks (greedy
tokens equal: tests/workers/test_expert_rebalance.py).

The swap (``ExpertRebalancer``, the one owner of the lifecycle):

    idle --(a step whose inputs carry expert_rebalance)--> planning
    planning: the layers' loads since the last plan, broadcast from the group's first rank
              (every rank plans from the same numbers), one ``LayerPlan`` per layer
    swapping: each following step, before its forward, one layer: the copies that change
              travel from their home ranks (``all_to_all_single``), then that layer's map
              switches; the other layers keep serving on their old maps
    -> idle once every layer has switched

Rank 0 decides when (``due``, every ``every_steps`` steps it prepares) and the flag travels
in the step's inputs (``StepInputs.expert_rebalance``), so every rank of the replica starts
at the same step, and each then advances one layer per step in lockstep. A step moves at
most ``R`` experts per rank of one layer: no step pauses every request for the whole
model's weights. Spares are rewritten only between forwards (on the step's stream), so no
forward reads a half-written slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from workers.models.eplb_policy import EMPTY, LayerPlan, home_plan, plan_layer


class ExpertMap(nn.Module):
    """One MoE layer's logical -> physical expert map and its per-slot token counts."""

    def __init__(self, num_experts: int, ep_size: int, num_redundant: int) -> None:
        super().__init__()
        self.num_home = num_experts // ep_size
        self.num_slots = self.num_home + num_redundant  # per rank
        self.plan = home_plan(num_experts, ep_size, num_redundant)
        # [E, ep_size]: row e its copies' physical slots, home first, padded with home.
        self.register_buffer(
            "replica_slots", torch.zeros(num_experts, ep_size, dtype=torch.int64), False
        )
        self.register_buffer("num_copies", torch.ones(num_experts, dtype=torch.int64), False)
        # Tokens mapped so far: where the next forward's copy rotation starts. Every rank
        # runs the same forwards, so it is the same number everywhere without a message.
        self.register_buffer("num_mapped", torch.zeros((), dtype=torch.int64), False)
        # Pairs each physical slot computed since the model was built (rank load, measured).
        self.register_buffer(
            "slot_tokens", torch.zeros(ep_size * self.num_slots, dtype=torch.int64), False
        )
        self.switch(self.plan)

    def home_slot(self, expert: int) -> int:
        return self.plan.home_rank(expert) * self.num_slots + expert % self.num_home

    def spare_slot(self, rank: int, j: int) -> int:
        return rank * self.num_slots + self.num_home + j

    def switch(self, plan: LayerPlan) -> None:
        """Route by ``plan`` from the next forward on (in place: CUDA graphs keep reading
        the same buffers). The spares it names must hold their experts already."""
        rows, copies = [], []
        for e in range(plan.num_experts):
            slots = [self.home_slot(e)] + [
                self.spare_slot(r, plan.spares[r].index(e)) for r in plan.holders(e)[1:]
            ]
            copies.append(len(slots))
            rows.append(slots + [slots[0]] * (plan.ep_size - len(slots)))
        self.replica_slots.copy_(torch.tensor(rows, dtype=torch.int64))
        self.num_copies.copy_(torch.tensor(copies, dtype=torch.int64))
        self.plan = plan

    def physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each pair's physical slot [num_tokens, top_k]: copy ``n % copies`` of its expert,
        ``n`` the token's number counted over every forward so far (a token's k experts
        differ, so successive tokens alternate over the copies, also one token a step)."""
        num_tokens = topk_ids.shape[0]
        token = torch.arange(num_tokens, device=topk_ids.device)[:, None] + self.num_mapped
        self.num_mapped += num_tokens
        choice = token % self.num_copies[topk_ids]
        slots = self.replica_slots[topk_ids, choice]
        self.slot_tokens.scatter_add_(0, slots.flatten(), torch.ones_like(slots.flatten()))
        return slots

    def rank_tokens(self) -> list[int]:
        """Pairs each rank's slots computed so far (one copy to the host)."""
        return self.slot_tokens.view(-1, self.num_slots).sum(dim=1).tolist()


def move_copies(
    stacks: Sequence[torch.Tensor],
    old: LayerPlan,
    new: LayerPlan,
    ep_rank: int,
    group: dist.ProcessGroup | None,
) -> int:
    """Fill this rank's spare rows of the layer's expert ``stacks`` (each [S, ...], row
    ``j`` slot ``j``: ``w13`` / ``w2``, or their quantized tensors and scales) that ``new``
    changes from ``old``, each from its expert's home rank, in one ``all_to_all_single``
    of the rows' bytes (one message whatever the stacks' dtypes). Every rank of the group
    calls it with the same plans. Returns the experts moved in all."""
    num_home = new.num_home
    # (destination rank, spare index, expert): the same list, in the same order, everywhere.
    moves = [
        (dst, j, e)
        for dst, slots in enumerate(new.spares)
        for j, e in enumerate(slots)
        if e != EMPTY and e != old.spares[dst][j]
    ]
    if not moves:
        return 0
    sizes = [t[0].numel() * t.element_size() for t in stacks]  # bytes of one row of each

    def row_bytes(slot: int) -> torch.Tensor:
        return torch.cat([t[slot].contiguous().flatten().view(torch.uint8) for t in stacks])

    send_rows, send_splits, recv_splits = [], [], []
    for peer in range(new.ep_size):
        # Sent to peer: its moves of my home experts, by spare index (the order it expects).
        out = [e for dst, _, e in moves if dst == peer and new.home_rank(e) == ep_rank]
        send_rows += [row_bytes(e % num_home) for e in out]
        send_splits.append(len(out))
        recv_splits.append(
            sum(1 for dst, _, e in moves if dst == ep_rank and new.home_rank(e) == peer)
        )
    device = stacks[0].device
    empty = torch.empty(0, sum(sizes), dtype=torch.uint8, device=device)
    send = torch.stack(send_rows) if send_rows else empty
    recv = torch.empty(sum(recv_splits), sum(sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    mine = [(j, e) for dst, j, e in moves if dst == ep_rank]
    mine.sort(key=lambda m: (new.home_rank(m[1]), m[0]))  # the order the rows arrive in
    for row, (j, _) in zip(recv, mine, strict=True):
        for t, part in zip(stacks, row.split(sizes), strict=True):
            # clone: a byte offset that is no multiple of t's element size cannot be viewed
            t[num_home + j].copy_(part.clone().view(t.dtype).view_as(t[0]))
    return len(moves)


class ExpertRebalancer:
    """The swap's state machine for one rank's MoE layers (module docstring). Built by the
    engine on every rank of a replica; rank 0's runner asks ``due`` when it prepares a
    step, and every rank's runner calls ``on_step`` with that step's flag before its
    forward. Mutates the layers' spare expert weights and maps."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        every_steps: int,
        ep_rank: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        if every_steps < 1:
            raise ValueError(f"expert_rebalance_steps: must be >= 1, got {every_steps}")
        self.blocks = list(blocks)  # SparseMoeBlocks with an ``expert_map``
        self.every_steps = every_steps
        self.ep_rank = ep_rank
        self.group = group
        self._num_prepared = 0
        self._pending: deque[tuple[nn.Module, LayerPlan]] = deque()
        self._seen = [block.expert_tokens.clone() for block in self.blocks]
        self.num_swaps = 0  # rebalances whose every layer has switched
        self.num_moved = 0  # expert copies moved, all ranks together

    @property
    def is_swapping(self) -> bool:
        return bool(self._pending)

    def due(self) -> bool:
        """Rank 0, once per step it prepares: whether this step starts a rebalance."""
        self._num_prepared += 1
        return self._num_prepared % self.every_steps == 0

    def on_step(self, start: bool) -> None:
        """Every rank, before a step's forward: plan when ``start`` (ignored while a swap
        is still under way: every rank ignores it alike), then switch one layer."""
        if start and not self._pending and self.blocks:
            self._plan()
        if self._pending:
            block, plan = self._pending.popleft()
            old = block.expert_map.plan
            experts = block.experts
            stacks = [t.data for t in experts.stacked()]  # quantized: values and scales
            self.num_moved += move_copies(stacks, old, plan, self.ep_rank, self.group)
            block.expert_map.switch(plan)
            if not self._pending:
                self.num_swaps += 1

    def _plan(self) -> None:
        now = [block.expert_tokens.clone() for block in self.blocks]
        window = torch.stack([n - s for n, s in zip(now, self._seen, strict=True)])
        self._seen = now
        # The group's first rank's counts for all: routing is replicated, but one rank's
        # numbers make the plans identical by construction, not by float luck.
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(window, src, group=self.group)
        ep_size = self.blocks[0].expert_map.plan.ep_size
        num_redundant = len(self.blocks[0].expert_map.plan.spares[0])
        for block, load in zip(self.blocks, window.tolist(), strict=True):
            self._pending.append((block, plan_layer(load, ep_size, num_redundant)))


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE layers that have an expert map (rebalancing on), by layer."""
    blocks = [m for m in model.modules() if getattr(m, "expert_map", None) is not None]
    return sorted(blocks, key=lambda block: block.layer_idx)


def rank_load(model: nn.Module) -> list[list[int]]:
    """Per MoE layer, the pairs each rank's slots computed so far (measured, not planned)."""
    return [block.expert_map.rank_tokens() for block in moe_blocks(model)]
