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

- **shared cores**: where the fits see the pools slow each other (``StepModel``'s overlap
  term), each step also pays for the share of it the other pool computes: two passes,
  each pool beside the other's busy time from the pass before (``simulate``).

``typical_window`` builds the planner's predicted next window: a fixed draw of Poisson gaps
at a rate, with a mix's lengths (the same arrivals every tick, so a prediction moves with
the rate and the mix, not with one window's clustering).

Each step's fitted time is multiplied by one of the fit's recorded ratios measured / fitted
(``StepModel``'s spread, when it keeps one), taken in a fixed low-discrepancy order per
worker: a p90 is set by the slow steps, which a mean fit leaves out.

Deterministic (no random draws): the same inputs give the same figures, which the planner's
stability relies on. Cost: O(steps x workers), with no per-token Python work (a decode
step's KV tokens come from a running sum, finished sequences from a heap) and the fits
solved once per record, not per step: a 24-hour trace (7.4M tokens) in about 11 s here.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.planner.busy import BusyTimeline
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


def _poisson_gaps(count: int, seed: int) -> tuple[float, ...]:
    rng = random.Random(seed)
    return tuple(rng.expovariate(1.0) for _ in range(count))


_GAPS = _poisson_gaps(4096, 38)  # one fixed draw: the same typical window every time


def typical_window(
    mix: Sequence[SimRequest], rate: float, window_s: float, start_s: float
) -> list[SimRequest]:
    """A window of ``round(rate * window_s)`` arrivals from ``start_s``, spaced by a fixed
    draw of Poisson gaps scaled to fill the window (they cluster as Poisson arrivals do,
    and the same way every time: a prediction made from it moves with the rate and the mix,
    not with one window's luck), the requests' lengths taken evenly from ``mix``."""
    count = max(1, round(rate * window_s))
    gaps = [_GAPS[i % len(_GAPS)] for i in range(count)]
    scale = window_s / sum(gaps)
    out, t = [], start_s
    for i, gap in enumerate(gaps):
        t += gap * scale
        src = mix[i * len(mix) // count]
        out.append(SimRequest(t, src.prompt_tokens, src.output_tokens))
    return out


_GOLDEN = 0.6180339887498949  # Weyl sequence step: the spread's ratios in a mixed order


def spread_factor(spread: tuple[float, ...], step: int) -> float:
    """The ratio a worker's ``step``-th step is multiplied by (``StepModel`` spreads)."""
    return spread[int((step * _GOLDEN) % 1.0 * len(spread))] if spread else 1.0


def simulate_prefill(
    requests: Sequence[SimRequest],
    num_workers: int,
    model: StepModel,
    limits: PoolLimits,
    other_busy: BusyTimeline | None = None,
    busy_out: list[tuple[float, float]] | None = None,
) -> list[float]:
    """Each request's prefill completion time (absolute seconds), arrival order.
    ``other_busy``: when the decode pool computes (its share of a step slows it, shared
    cores); ``busy_out``, when given, gets every step's (start, end)."""
    done = [0.0] * len(requests)
    queues: list[deque[list[int]]] = [deque() for _ in range(num_workers)]  # [req, left]
    queued_tokens = [0] * num_workers
    busy_until = [0.0] * num_workers
    events: list[tuple[float, int, int]] = []  # (time, kind 0=step done 1=arrival, index)
    for i, req in enumerate(requests):
        heapq.heappush(events, (req.arrival_s, 1, i))
    # per worker: the step in progress as (request, chunk tokens, is its last chunk)
    running: list[list[tuple[int, int, bool]]] = [[] for _ in range(num_workers)]
    budget_per_step = limits.max_batched_tokens
    prefill_seconds = model.prefill_seconds
    spread = model.prefill.spread()
    num_steps = [0] * num_workers

    def start_step(worker: int, now: float) -> None:
        budget, chunks, work = budget_per_step, [], 0.0
        queue = queues[worker]
        while queue and budget > 0:
            entry = queue[0]
            index, left = entry
            take = left if left < budget else budget
            context = requests[index].prompt_tokens - left + take
            work += take * context / 1000.0
            budget -= take
            entry[1] = left - take
            chunks.append((index, take, entry[1] == 0))
            if entry[1] == 0:
                queue.popleft()
        tokens = budget_per_step - budget
        seconds = prefill_seconds(tokens, work)
        if other_busy is not None:
            seconds = prefill_seconds(tokens, work, other_busy.share(now, now + seconds))
        if spread:
            seconds *= spread_factor(spread, num_steps[worker])
            num_steps[worker] += 1
        busy_until[worker] = now + seconds
        if busy_out is not None:
            busy_out.append((now, now + seconds))
        running[worker] = chunks
        heapq.heappush(events, (busy_until[worker], 0, worker))

    while events:
        now, kind, index = heapq.heappop(events)
        if kind == 1:
            tokens = max(requests[index].prompt_tokens, 1)
            worker = min(range(num_workers), key=lambda w: (queued_tokens[w], w))
            queues[worker].append([index, tokens])
            queued_tokens[worker] += tokens
            if busy_until[worker] <= now and not running[worker]:
                start_step(worker, now)
            continue
        for req_index, take, is_last in running[index]:
            queued_tokens[index] -= take
            if is_last:
                done[req_index] = now
        running[index] = []
        if queues[index]:
            start_step(index, now)
    return done


@dataclass
class DecodeSpans:
    """Which decode steps gave each request its tokens, kept only when asked for (the
    validation groups ITL by request; the planner needs the pooled figures only)."""

    step_s: list[list[float]] = field(default_factory=list)  # per worker, each step's time
    spans: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # req: worker, from, to

    def itl_of(self, index: int) -> list[float]:
        """The request's inter-token times (its decode steps'); [] for one token."""
        span = self.spans.get(index)
        return [] if span is None else self.step_s[span[0]][span[1] : span[2]]


def simulate_decode(
    requests: Sequence[SimRequest],
    ready_s: Sequence[float],
    num_workers: int,
    model: StepModel,
    limits: PoolLimits,
    spans: DecodeSpans | None = None,
    other_busy: BusyTimeline | None = None,
    busy_out: list[tuple[float, float]] | None = None,
) -> list[float]:
    """Every generated token's inter-token time, for requests arriving at ``ready_s``;
    ``spans``, when given, is filled with each request's steps; ``other_busy`` and
    ``busy_out`` as for ``simulate_prefill``."""
    order = sorted(range(len(requests)), key=lambda i: ready_s[i])
    waiting: deque[int] = deque()
    # No per-token work: a worker counts its steps, and a sequence that joins at step n0 with
    # context c0 and k tokens to give has context c0 + (n - n0) at step n and leaves after
    # step n0 + k - 1. So a step's KV tokens are ``kv_base + batch * steps`` with
    # ``kv_base`` the sum of (c0 - n0) over the running sequences, and the finishing ones
    # are the heap's smallest ends.
    ends: list[list[tuple[int, int]]] = [[] for _ in range(num_workers)]  # (end step, c0 - n0)
    kv_base = [0] * num_workers
    steps = [0] * num_workers
    clock = [0.0] * num_workers
    itl: list[float] = []
    next_arrival = 0
    max_num_seqs = limits.max_num_seqs
    decode_seconds = model.decode_seconds
    spread = model.decode.spread()
    if spans is not None:
        spans.step_s = [[] for _ in range(num_workers)]

    def admit(now: float) -> None:
        nonlocal next_arrival
        while next_arrival < len(order) and ready_s[order[next_arrival]] <= now:
            waiting.append(order[next_arrival])
            next_arrival += 1
        while waiting:
            worker = min(range(num_workers), key=lambda w: (len(ends[w]), w))
            if len(ends[worker]) >= max_num_seqs:
                return
            index = waiting.popleft()
            req = requests[index]
            if req.output_tokens > 1:  # the first token came from prefill
                n0 = steps[worker]
                base = req.prompt_tokens + 1 - n0
                heapq.heappush(ends[worker], (n0 + req.output_tokens - 1, base))
                kv_base[worker] += base
                if spans is not None:
                    spans.spans[index] = (worker, n0, n0 + req.output_tokens - 1)
            if clock[worker] < now:
                clock[worker] = now

    while next_arrival < len(order) or waiting or any(ends):
        busy = [w for w in range(num_workers) if ends[w]]
        if not busy:  # idle: the next arrival, or the ones left waiting when all were full
            admit(max(clock) if waiting else ready_s[order[next_arrival]])
            continue
        worker = min(busy, key=lambda w: (clock[w], w))
        now = clock[worker]
        admit(now)
        heap = ends[worker]
        batch = len(heap)
        n = steps[worker]
        kv_tokens = kv_base[worker] + batch * n
        step = decode_seconds(batch, kv_tokens)
        if other_busy is not None:
            step = decode_seconds(batch, kv_tokens, other_busy.share(now, now + step))
        if spread:
            step *= spread_factor(spread, n)
        clock[worker] = now + step
        if busy_out is not None:
            busy_out.append((now, now + step))
        itl.extend([step] * batch)
        if spans is not None:
            spans.step_s[worker].append(step)
        n += 1
        steps[worker] = n
        while heap and heap[0][0] <= n:
            kv_base[worker] -= heapq.heappop(heap)[1]
    return itl


def simulate(
    requests: Sequence[SimRequest],
    num_prefill: int,
    num_decode: int,
    model: StepModel,
    limits: PoolLimits = PoolLimits(),
    spans: DecodeSpans | None = None,
) -> SimResult:
    """Both pools in sequence (the prefill pool's output is the decode pool's input).

    Where the fits see the pools slow each other (``StepModel.has_interference``: shared
    cores), each pool's steps depend on when the other computes, and the other way round:
    two passes settle it (prefill alone, decode beside it, prefill beside that decode,
    decode beside that prefill), each step costed with the share of it the other pool's
    previous pass was busy."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"simulate needs a worker in each pool, got ({num_prefill}, {num_decode})")
    prefill_busy: list[tuple[float, float]] | None = None
    decode_busy: BusyTimeline | None = None
    if model.has_interference:
        prefill_busy, first_decode = [], []
        done = simulate_prefill(requests, num_prefill, model, limits, busy_out=prefill_busy)
        ready = [d + limits.handoff_s for d in done]
        simulate_decode(
            requests, ready, num_decode, model, limits, None, BusyTimeline(prefill_busy),
            first_decode,
        )  # fmt: skip
        decode_busy, prefill_busy = BusyTimeline(first_decode), []
    done = simulate_prefill(requests, num_prefill, model, limits, decode_busy, prefill_busy)
    ttft = tuple(d - r.arrival_s for d, r in zip(done, requests, strict=True))
    ready = [d + limits.handoff_s for d in done]
    other = None if prefill_busy is None else BusyTimeline(prefill_busy)
    itl = simulate_decode(requests, ready, num_decode, model, limits, spans, other)
    return SimResult(ttft, tuple(itl))
