"""Routing policy: pure functions from cluster state to a decision (no I/O, no clocks).

For each request the router asks :func:`route` for a decode worker and, when the request
is to be disaggregated, a prefill worker. A worker's state is its last report (load,
health, KV blocks, which prefix-block hashes its cache holds) *plus* what the router has
routed to it since and not yet seen end (``router/workers.py``): under a burst every
request is routed before any report could count the previous ones, so the report alone
sends the whole burst to one worker. The only state a policy keeps across requests is
the cursor, passed in and returned: one step per request.

- ``round_robin``: the next healthy worker after the cursor.
- ``least_loaded``: fewest running + waiting + incoming requests, then the lowest KV usage.
- ``kv_aware``: the lowest cost ``overlap_weight × prefill blocks + decode blocks`` (as
  Dynamo's KV router): the prompt blocks the worker would still compute (its cached prefix
  does not count) plus the prompt tokens already queued there, and the KV blocks in use
  there (reported, plus the routed requests' expected ones). A prefix block the worker
  holds in a tier below its pool (G2 host memory, G3 disk) is onboarded, not computed: it
  counts as a fraction of a prefill block (``host_tier_weight``, ``disk_tier_weight``).
  A decode worker fed by a prefill worker computes none of the prompt but receives the
  blocks it lacks (partial receive): each counts ``receive_weight`` of a prefill block.
  When the pool's load is out of balance (most - least loaded > ``balance_abs_requests``
  and most > ``balance_rel`` × least, SGLang's cache-aware test), load wins:
  ``least_loaded`` decides.

Exact ties go round robin over the tied workers (by the cursor), never by name: a burst
onto idle equal workers spreads from its first request.

Disaggregation ``auto`` prefills on the decode worker when the part of the prompt that
worker has not cached (in any tier) is at most ``auto_local_prefill_tokens``, or when
every prefill worker is saturated (its waiting queue at least ``saturated_queue``);
otherwise it hands off (with no healthy prefill worker it degrades to local prefill).
``always`` and ``never`` force the choice; ``always`` with no healthy prefill worker raises
``NoHealthyWorker``, which the router answers with UNAVAILABLE.

A draining worker (being scaled down: router/scaling.py) is skipped like an unhealthy one:
it takes nothing new while its running requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["round_robin", "least_loaded", "kv_aware"]
Disaggregation = Literal["always", "never", "auto"]


class NoHealthyWorker(Exception):
    """A pool the request needs has no healthy worker (the router answers UNAVAILABLE)."""


@dataclass(frozen=True)
class WorkerState:
    """A worker as the policy sees it: its last report plus what was routed to it since."""

    name: str
    healthy: bool = True
    is_draining: bool = False  # being scaled down: takes no new request (router/scaling.py)
    num_running: int = 0
    num_waiting: int = 0
    num_incoming: int = 0  # routed here, not yet submitted here (decode: still in prefill)
    num_prefill_tokens: int = 0  # prompt tokens routed here and not yet computed
    kv_blocks_used: int = 0  # reported, plus the incoming requests' prompt blocks
    kv_blocks_total: int = 0
    cached_hashes: Set[int] = frozenset()  # prefix-block hashes its pool (G1) holds
    # The tiers below the pool, in the worker's lookup order: (name, hashes it holds). The
    # router's live sets (router/workers.py), not copies: read them during one route only.
    tier_hashes: tuple[tuple[str, Set[int]], ...] = ()

    @property
    def is_routable(self) -> bool:
        return self.healthy and not self.is_draining

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.num_incoming

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class KVWeights:
    """``kv_aware``'s constants (``router.kv_*`` in the config; docs/config.md)."""

    # Defaults measured (bench/RESULTS.md, "Routing under bursts"): 2.0 kept each shared
    # prefix on one worker more often than Dynamo's 1.0 did, with a lower TTFT p99.
    overlap_weight: float = 2.0  # a prefill block against a decode block in use
    balance_abs_requests: int = 4  # load wins past this spread (requests) ...
    balance_rel: float = 1.5  # ... when the most loaded also has this × the least's
    # A prompt block onboarded from a tier below the pool, against computing it (a block in
    # the pool costs 0, one held nowhere 1). Reasoned (docs/kv-tiers.md, "Events, routing
    # and metrics"): a block of Llama-3.1-8B (2 MiB) copies from pinned host memory in about
    # a tenth of the time its 16 tokens take to prefill on an H100, and reads from an NVMe
    # disk in about half of it.
    host_tier_weight: float = 0.1
    disk_tier_weight: float = 0.5
    # A prompt block a decode worker fed by a prefill worker receives over the hand-off,
    # against computing it: the blocks it holds already it does not receive (partial
    # receive). Reasoned likewise: 2 MiB over a 25 to 50 GB/s RDMA NIC takes 0.04 to
    # 0.08 ms, about a tenth of its prefill. Small on purpose: it only tilts the choice
    # between decode workers of about equal load towards the one that holds more.
    receive_weight: float = 0.1

    def tier_weight(self, tier: str) -> float:
        """The onboarding weight of tier ``tier`` (any other than host: as slow as disk)."""
        return self.host_tier_weight if tier == "host" else self.disk_tier_weight


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks, in order
    block_size: int
    weights: KVWeights = field(default_factory=KVWeights)


@dataclass(frozen=True)
class RouteDecision:
    decode: str
    prefill: str | None  # None: the decode worker prefills itself
    cached_tokens: int  # prompt tokens the chosen prefilling worker already holds
    round_robin_cursor: int  # pass back in with the next request


def cached_prefix_blocks(worker: WorkerState, block_hashes: Sequence[int]) -> int:
    """Leading blocks of the prompt that the worker holds in its pool or any tier below
    it: the blocks it would not compute."""
    return _cached_prefix(worker, block_hashes, KVWeights())[0]


def _cached_prefix(
    worker: WorkerState, block_hashes: Sequence[int], weights: KVWeights
) -> tuple[int, float]:
    """``(blocks, onboard cost)``: the leading prompt blocks the worker holds anywhere, and
    what bringing them into its pool costs, in prefill blocks (each block from the first
    tier in lookup order that holds it; the pool's cost nothing)."""
    count, cost = 0, 0.0
    for block_hash in block_hashes:
        if block_hash not in worker.cached_hashes:
            for tier, held in worker.tier_hashes:
                if block_hash in held:
                    cost += weights.tier_weight(tier)
                    break
            else:
                break
        count += 1
    return count, cost


def pick(
    policy: Policy,
    workers: Sequence[WorkerState],
    req: RouteRequest,
    cursor: int,
    *,
    prefills: bool = True,
) -> WorkerState:
    """Choose one healthy worker of a pool. ``prefills``: the chosen worker computes the
    prompt (kv_aware counts a block it lacks as one to compute); otherwise it is a decode
    worker fed by a prefill worker, which receives the blocks it lacks (each costs
    ``receive_weight`` of one to compute)."""
    healthy = [w for w in workers if w.is_routable]
    if not healthy:
        raise NoHealthyWorker("no healthy worker in the pool")
    if policy == "round_robin":
        return healthy[cursor % len(healthy)]
    if policy == "least_loaded" or (policy == "kv_aware" and _out_of_balance(healthy, req)):
        return _lowest(healthy, _load_key, cursor)
    if policy == "kv_aware":
        return _lowest(healthy, lambda w: _cost(w, req, prefills), cursor)
    raise ValueError(f"unknown policy {policy!r}")


def _lowest(workers: list[WorkerState], key: Callable, cursor: int) -> WorkerState:
    """The worker with the lowest key; exact ties round robin by the cursor."""
    best = min(key(w) for w in workers)
    tied = [w for w in workers if key(w) == best]
    return tied[cursor % len(tied)]


def _load_key(worker: WorkerState) -> tuple[int, float]:
    return (worker.load, worker.kv_usage)


def _out_of_balance(workers: list[WorkerState], req: RouteRequest) -> bool:
    loads = [w.load for w in workers]
    most, least = max(loads), min(loads)
    w = req.weights
    return most - least > w.balance_abs_requests and most > w.balance_rel * least


def _cost(worker: WorkerState, req: RouteRequest, prefills: bool) -> float:
    """Dynamo's ``overlap_weight × prefill blocks + decode blocks``, in blocks."""
    # This request's prompt blocks the worker lacks: to compute there, or (fed by a prefill
    # worker) to receive, a fraction of that; those its tiers hold are onboarded either way.
    cached, onboard = _cached_prefix(worker, req.block_hashes, req.weights)
    lacking = (req.num_prompt_tokens - cached * req.block_size) / req.block_size
    new_blocks = (lacking if prefills else req.weights.receive_weight * lacking) + onboard
    prefill_blocks = worker.num_prefill_tokens / req.block_size + new_blocks
    return req.weights.overlap_weight * prefill_blocks + worker.kv_blocks_used


def scores(
    policy: Policy, workers: Sequence[WorkerState], req: RouteRequest, *, prefills: bool = True
) -> list[str]:
    """What :func:`pick` compared, per healthy worker, as ``name=score`` (for a trace):
    kv_aware's cost in blocks, else the load (requests). Lower wins."""
    healthy = [w for w in workers if w.is_routable]
    if policy == "kv_aware" and healthy and not _out_of_balance(healthy, req):
        return [f"{w.name}={_cost(w, req, prefills):.2f}" for w in healthy]
    return [f"{w.name}={w.load}" for w in healthy]


def route(
    req: RouteRequest,
    prefill_pool: Sequence[WorkerState],
    decode_pool: Sequence[WorkerState],
    *,
    policy: Policy,
    disaggregation: Disaggregation,
    auto_local_prefill_tokens: int,
    saturated_queue: int,
    cursor: int = 0,
) -> RouteDecision:
    """Pick the decode worker, and the prefill worker when the request is handed off."""
    # One cursor step per request: request n goes to decode worker n and prefill worker n
    # (each modulo its pool, or among its tied). Stepping it for each pool would send
    # every request to the same decode worker when the pools add up to an even step.
    next_cursor = cursor + 1
    decode = pick(policy, decode_pool, req, cursor, prefills=disaggregation != "always")
    local_cached = cached_prefix_blocks(decode, req.block_hashes) * req.block_size
    if disaggregation == "never":
        return RouteDecision(decode.name, None, local_cached, next_cursor)
    healthy_prefill = [w for w in prefill_pool if w.is_routable]
    if disaggregation == "auto":
        uncached = req.num_prompt_tokens - local_cached
        saturated = all(w.num_waiting >= saturated_queue for w in healthy_prefill)
        if uncached <= auto_local_prefill_tokens or saturated:
            return RouteDecision(decode.name, None, local_cached, next_cursor)
    prefill = pick(policy, healthy_prefill, req, cursor)
    cached = cached_prefix_blocks(prefill, req.block_hashes) * req.block_size
    return RouteDecision(decode.name, prefill.name, cached, next_cursor)
