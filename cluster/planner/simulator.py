"""A discrete-event simulation of the two pools: p90 TTFT and ITL for a candidate (P, D).

Why simulate rather than divide throughput by capacity: a pool at 80% of its capacity can
meet a throughput target and still miss a p90, and a bimodal mix (a few 8k-token prompts
among short ones) queues very differently from its mean. The simulation replays the
requests (arrival time, uncached prompt tokens, output tokens) through:

- **prefill**: ``num_prefill`` workers; a request goes to the worker with the fewest queued
  tokens (the router's least-loaded choice); a worker runs one step at a time over its queue
  in arrival order, up to ``max_batched_tokens`` tokens per step (chunked prefill: a long
  prompt spans steps), each step costing ``StepModel.prefill_seconds``. The first token is
  out when the request's last chunk is done: TTFT = that time - arrival.
- **hand-off**: ``handoff_s`` later the request reaches the decode pool.
- **decode**: ``num_decode`` workers; a request joins the worker with the fewest running
  sequences at its next step (waiting while all are at ``max_num_seqs``); every step gives
  each running sequence one token and costs ``StepModel.decode_seconds(batch, kv_tokens)``;
  each token's ITL is its step's time.

Deterministic (no random draws): the same inputs give the same figures, which the planner's
stability relies on. Cost: O(steps x workers); a minute of traffic at a few requests per
second simulates in milliseconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.planner.step_model import StepModel


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int  # uncached: a prefix hit's tokens are not computed again
    output_tokens: int


@dataclass(frozen=True)
class PoolLimits:
    """The engine settings the simulation follows (the pools' config)."""

    max_batched_tokens: int = 2048
    max_num_seqs: int = 64
    handoff_s: float = 0.005


@dataclass(frozen=True)
class SimResult:
    ttft_s: tuple[float, ...]  # one per request, arrival order
    itl_s: tuple[float, ...]  # one per generated token after the first

    @property
    def ttft_p90(self) -> float:
        return percentile(self.ttft_s, 0.9)

    @property
    def itl_p90(self) -> float:
        return percentile(self.itl_s, 0.9)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


def simulate_prefill(
    requests: Sequence[SimRequest], num_workers: int, model: StepModel, limits: PoolLimits
) -> list[float]:
    """Each request's prefill completion time (absolute seconds), arrival order."""
    done = [0.0] * len(requests)
    queues: list[deque[list[int]]] = [deque() for _ in range(num_workers)]  # [req, left]
    queued_tokens = [0] * num_workers
    busy_until = [0.0] * num_workers
    events: list[tuple[float, int, int]] = []  # (time, kind 0=step done 1=arrival, index)
    for i, req in enumerate(requests):
        heapq.heappush(events, (req.arrival_s, 1, i))
    running: list[list[tuple[int, int]]] = [[] for _ in range(num_workers)]

    def start_step(worker: int, now: float) -> None:
        budget, chunks, work = limits.max_batched_tokens, [], 0.0
        queue = queues[worker]
        while queue and budget > 0:
            entry = queue[0]
            req = requests[entry[0]]
            take = min(entry[1], budget)
            context = req.prompt_tokens - entry[1] + take
            work += take * context / 1000.0
            chunks.append((entry[0], take))
            budget -= take
            entry[1] -= take
            if entry[1] == 0:
                queue.popleft()
        tokens = limits.max_batched_tokens - budget
        busy_until[worker] = now + model.prefill_seconds(tokens, work)
        running[worker] = chunks
        heapq.heappush(events, (busy_until[worker], 0, worker))

    while events:
        now, kind, index = heapq.heappop(events)
        if kind == 1:
            req = requests[index]
            worker = min(range(num_workers), key=lambda w: (queued_tokens[w], w))
            queues[worker].append([index, max(req.prompt_tokens, 1)])
            queued_tokens[worker] += max(req.prompt_tokens, 1)
            if busy_until[worker] <= now and not running[worker]:
                start_step(worker, now)
            continue
        for req_index, take in running[index]:
            queued_tokens[index] -= take
            if not any(e[0] == req_index for e in queues[index]):
                done[req_index] = now
        running[index] = []
        if queues[index]:
            start_step(index, now)
    return done


def simulate_decode(
    requests: Sequence[SimRequest],
    ready_s: Sequence[float],
    num_workers: int,
    model: StepModel,
    limits: PoolLimits,
) -> list[float]:
    """Every generated token's inter-token time, for requests arriving at ``ready_s``."""
    order = sorted(range(len(requests)), key=lambda i: ready_s[i])
    waiting: deque[int] = deque()
    # per worker: the running sequences as [tokens left, context length]
    running: list[list[list[int]]] = [[] for _ in range(num_workers)]
    clock = [0.0] * num_workers
    itl: list[float] = []
    next_arrival = 0

    def admit(now: float) -> None:
        nonlocal next_arrival
        while next_arrival < len(order) and ready_s[order[next_arrival]] <= now:
            waiting.append(order[next_arrival])
            next_arrival += 1
        while waiting:
            worker = min(range(num_workers), key=lambda w: (len(running[w]), w))
            if len(running[worker]) >= limits.max_num_seqs:
                return
            req = requests[waiting.popleft()]
            if req.output_tokens > 1:  # the first token came from prefill
                running[worker].append([req.output_tokens - 1, req.prompt_tokens + 1])
            clock[worker] = max(clock[worker], now)

    while next_arrival < len(order) or waiting or any(running):
        busy = [w for w in range(num_workers) if running[w]]
        if not busy:  # idle: the next arrival, or the ones left waiting when all were full
            admit(max(clock) if waiting else ready_s[order[next_arrival]])
            continue
        worker = min(busy, key=lambda w: (clock[w], w))
        now = clock[worker]
        admit(now)
        seqs = running[worker]
        step = model.decode_seconds(len(seqs), sum(s[1] for s in seqs))
        clock[worker] = now + step
        itl.extend([step] * len(seqs))
        for seq in seqs:
            seq[0] -= 1
            seq[1] += 1
        running[worker] = [s for s in seqs if s[0] > 0]
    return itl


def simulate(
    requests: Sequence[SimRequest],
    num_prefill: int,
    num_decode: int,
    model: StepModel,
    limits: PoolLimits = PoolLimits(),
) -> SimResult:
    """Both pools in sequence (the prefill pool's output is the decode pool's input)."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"simulate needs a worker in each pool, got ({num_prefill}, {num_decode})")
    done = simulate_prefill(requests, num_prefill, model, limits)
    ttft = tuple(d - r.arrival_s for d, r in zip(done, requests, strict=True))
    ready = [d + limits.handoff_s for d in done]
    itl = simulate_decode(requests, ready, num_decode, model, limits)
    return SimResult(ttft, tuple(itl))
