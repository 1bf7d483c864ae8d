"""Routing policy: pure functions from cluster state to a decision (no I/O, no clocks).

For each request the router asks :func:`route` for a decode worker and, when the request
is to be disaggregated, a prefill worker. Inputs are snapshots the workers report
(load, health, which prefix-block hashes their caches hold); the only state a policy keeps
across requests is the round-robin cursor, passed in and returned.

- ``round_robin``: the next healthy worker after the cursor.
- ``least_loaded``: fewest running + waiting requests, then lowest KV usage, then name.
- ``kv_aware``: longest cached prefix of the prompt (counted in leading full blocks whose
  chained hash the worker holds), ties broken as ``least_loaded``.

Disaggregation ``auto`` prefills on the decode worker when the part of the prompt that
worker has not cached is at most ``auto_local_prefill_tokens``, or when every prefill
worker is saturated (its waiting queue at least ``saturated_queue``); otherwise it hands
off (with no healthy prefill worker it degrades to local prefill). ``always`` and ``never``
force the choice; ``always`` with no healthy prefill worker raises ``NoHealthyWorker``, which
the router answers with UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Policy = Literal["round_robin", "least_loaded", "kv_aware"]
Disaggregation = Literal["always", "never", "auto"]


class NoHealthyWorker(Exception):
    """A pool the request needs has no healthy worker (the router answers UNAVAILABLE)."""


@dataclass(frozen=True)
class WorkerState:
    """What a worker last reported about itself."""

    name: str
    healthy: bool = True
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # blocks in use / total
    cached_hashes: frozenset[int] = frozenset()  # prefix-block hashes its cache holds

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks, in order
    block_size: int


@dataclass(frozen=True)
class RouteDecision:
    decode: str
    prefill: str | None  # None: the decode worker prefills itself
    cached_tokens: int  # prompt tokens the chosen prefilling worker already holds
    round_robin_cursor: int  # pass back in with the next request


def cached_prefix_blocks(worker: WorkerState, block_hashes: Sequence[int]) -> int:
    """Leading blocks of the prompt that the worker's cache holds."""
    count = 0
    for block_hash in block_hashes:
        if block_hash not in worker.cached_hashes:
            break
        count += 1
    return count


def pick(
    policy: Policy, workers: Sequence[WorkerState], req: RouteRequest, cursor: int
) -> tuple[WorkerState, int]:
    """Choose one healthy worker of a pool; returns it and the new round-robin cursor."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        raise NoHealthyWorker("no healthy worker in the pool")
    if policy == "round_robin":
        chosen = healthy[cursor % len(healthy)]
        return chosen, cursor + 1
    if policy == "least_loaded":
        return min(healthy, key=_load_key), cursor
    if policy == "kv_aware":
        return min(
            healthy, key=lambda w: (-cached_prefix_blocks(w, req.block_hashes), *_load_key(w))
        ), cursor
    raise ValueError(f"unknown policy {policy!r}")


def _load_key(worker: WorkerState) -> tuple[int, float, str]:
    return (worker.load, worker.kv_usage, worker.name)


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
    # Round robin: request n goes to decode worker n and prefill worker n (each modulo
    # its pool): one cursor step per request. (Stepping it for each pool would send
    # every request to the same decode worker when the pools add up to an even step.)
    decode, next_cursor = pick(policy, decode_pool, req, cursor)
    local_cached = cached_prefix_blocks(decode, req.block_hashes) * req.block_size
    if disaggregation == "never":
        return RouteDecision(decode.name, None, local_cached, next_cursor)
    healthy_prefill = [w for w in prefill_pool if w.healthy]
    if disaggregation == "auto":
        uncached = req.num_prompt_tokens - local_cached
        saturated = all(w.num_waiting >= saturated_queue for w in healthy_prefill)
        if uncached <= auto_local_prefill_tokens or saturated:
            return RouteDecision(decode.name, None, local_cached, next_cursor)
    prefill, _ = pick(policy, healthy_prefill, req, cursor)
    cached = cached_prefix_blocks(prefill, req.block_hashes) * req.block_size
    return RouteDecision(decode.name, prefill.name, cached, next_cursor)
