"""Where a MoE layer's redundant expert copies go: a pure function of the layer's load.

After DeepSeek's EPLB and vLLM's (``vllm/distributed/eplb/``), simplified to what a
replica of a few ranks needs. Each of the ``ep_size`` ranks has ``E / ep_size`` *home*
slots (its consecutive share of the experts, ``ExpertPlacement``) and ``num_redundant``
spare slots. Home slots never move: every expert always has its home copy, so a swap only
ever rewrites spare slots and the map before and after a swap are both complete. (vLLM
re-packs every slot; that balances better when whole ranks are hot but moves up to every
expert's weights, where ours moves at most ``num_redundant`` per rank.)

The policy, greedy on the busiest rank: while a spare slot is free, take the rank whose
estimated load is highest, its expert with the largest load per copy that some other rank
can still take (a free slot, no copy yet), and give one copy to the least loaded such
rank. A replicated expert's tokens are spread evenly over its copies
(``workers/models/expert_rebalance.py`` alternates them by pair index), so each copy's
estimated load is ``load / copies``. It stops early when a copy would not lower the busiest
rank (a copy of a cold expert only costs its weights' transfer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

EMPTY = -1  # a spare slot holding no expert


@dataclass(frozen=True)
class LayerPlan:
    """One layer's spare slots: ``spares[r][j]`` the expert in rank ``r``'s ``j``-th spare
    slot, or ``EMPTY``."""

    num_experts: int
    spares: tuple[tuple[int, ...], ...]

    @property
    def ep_size(self) -> int:
        return len(self.spares)

    @property
    def num_home(self) -> int:
        return self.num_experts // self.ep_size

    def home_rank(self, expert: int) -> int:
        return expert // self.num_home

    def holders(self, expert: int) -> tuple[int, ...]:
        """The ranks holding a copy of ``expert``: its home rank first, then by rank."""
        home = self.home_rank(expert)
        spare = (r for r, slots in enumerate(self.spares) if r != home and expert in slots)
        return (home, *spare)

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Each rank's estimated load: ``load[e] / copies(e)`` per copy it holds."""
        copies = [len(self.holders(e)) for e in range(self.num_experts)]
        out = [0.0] * self.ep_size
        for e in range(self.num_experts):
            for r in self.holders(e):
                out[r] += load[e] / copies[e]
        return out


def home_plan(num_experts: int, ep_size: int, num_redundant: int) -> LayerPlan:
    """Every spare slot empty: the placement before any rebalance."""
    if ep_size < 2 or num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over {ep_size} ranks")
    return LayerPlan(num_experts, tuple((EMPTY,) * num_redundant for _ in range(ep_size)))


def plan_layer(load: Sequence[float], ep_size: int, num_redundant: int) -> LayerPlan:
    """The spare slots for a layer whose experts received ``load`` (pairs per expert, any
    window). Deterministic: ties go to the lower expert id and the lower rank. Pure."""
    num_experts = len(load)
    plan = home_plan(num_experts, ep_size, num_redundant)
    if num_redundant < 0 or num_redundant > num_experts - plan.num_home:
        raise ValueError(
            f"{num_redundant} spare slots per rank: at most {num_experts - plan.num_home} "
            f"(the experts a rank does not hold already)"
        )
    spares = [list(slots) for slots in plan.spares]
    held = [{e for e in range(num_experts) if plan.home_rank(e) == r} for r in range(ep_size)]
    copies = [1] * num_experts
    rank_load = [sum(load[e] for e in held[r]) for r in range(ep_size)]
    while True:
        move = _best_copy(load, held, spares, copies, rank_load)
        if move is None:
            break
        expert, dst = move
        before = load[expert] / copies[expert]
        copies[expert] += 1
        after = load[expert] / copies[expert]
        for r in range(ep_size):  # every holder's share of the expert shrinks
            if expert in held[r]:
                rank_load[r] -= before - after
        held[dst].add(expert)
        rank_load[dst] += after
        spares[dst][spares[dst].index(EMPTY)] = expert
    return LayerPlan(num_experts, tuple(tuple(slots) for slots in spares))


def _best_copy(
    load: Sequence[float],
    held: list[set[int]],
    spares: list[list[int]],
    copies: list[int],
    rank_load: list[float],
) -> tuple[int, int] | None:
    """(expert, destination rank) of the next copy, or None when no copy helps."""
    ep_size = len(held)
    hot = max(range(ep_size), key=lambda r: (rank_load[r], -r))
    peak = rank_load[hot]
    for expert in sorted(held[hot], key=lambda e: (-load[e] / copies[e], e)):
        takers = [r for r in range(ep_size) if EMPTY in spares[r] and expert not in held[r]]
        if not takers or load[expert] == 0:
            continue
        dst = min(takers, key=lambda r: (rank_load[r], r))
        share = load[expert] / (copies[expert] + 1)
        # Worth it only when the hot rank drops and the taker stays below the old peak.
        if rank_load[dst] + share < peak:
            return expert, dst
    return None


def max_over_mean(rank_load: Sequence[float]) -> float:
    """The busiest rank's load over the mean rank's (1.0 when balanced or idle)."""
    mean = sum(rank_load) / len(rank_load)
    return max(rank_load) / mean if mean else 1.0
