"""The planner's observations, gathered from what the router already hears (its
``LoadObserver``: ``router/observer.py``), one window per tick.

The workers send no step records of their own: each engine step's token events reach the
router as one batch with the worker's report (``workers/serving/service.py``), so a
worker's steps are read off its batches here, router-side:

- **a step's time**: from the worker's previous batch that carried a step's output or,
  when later, the moment the step's newest request could have started there (its arrival
  at a prefill worker, its prefill's end at a decode worker: an idle gap is not a step),
  to this batch, as the router receives it. A batch without output (a heartbeat report, a
  receive's notice) does not start a step: the work between two steps (taking in handed-off
  KV, commands, the events' delivery) delays every running request's next token as much as
  the step itself (a record that started at a heartbeat was short of the tokens' gap; the
  validation against real engines, ``bench/planner_validate.py``, compares the two);
- **prefill**: the requests whose first token (or KV handle) the batch carries, with their
  uncached prompt tokens (``num_prompt_tokens - num_cached_tokens``). A long prompt's
  chunks before its last send nothing, so one record may span several steps (the fit's
  per-step constant is then counted once for them: a small underestimate for long prompts);
- **decode**: the requests the batch gives tokens, their context lengths summed;
- **overlap** (at ``take``): the share of each record's span during which the other pool's
  records ran (pools on shared cores slow each other: ``cluster/planner/busy.py``).

A restarted worker (a new client under the old name) and a new worker (a new name) get a
new ``worker_id``, so ``StepModel`` leaves their first steps out (cold starts).

From the router's side besides: the window's arrivals with their prompt and output lengths
(a request still running counts with a recent finished request's output length, at least
its tokens so far), the prefix-hit share, and the measured TTFT and per-token ITL samples
(the planner's measured p90s).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cluster.planner.busy import BusyTimeline
from cluster.planner.simulator import SimRequest
from cluster.planner.step_model import DecodeStep, PrefillStep
from router.workers import WorkerView
from workers.protocol.wire import OutputBatch

_NUM_RECENT_OUTPUTS = 256  # finished requests' output lengths kept for running ones
_FORGET_AFTER_S = 600.0  # a request never ended (its end was missed) is dropped then


@dataclass(frozen=True)
class Window:
    """What the router saw since the previous tick."""

    requests: tuple[SimRequest, ...]  # arrived in the window, arrival order
    steps: tuple[PrefillStep | DecodeStep, ...]
    ttft_s: tuple[float, ...]  # measured: requests whose first token came in the window
    itl_s: tuple[float, ...]  # measured: one per token after the first
    prefix_hit_share: float  # cached / prompt tokens of the window's first tokens
    num_waiting: dict[str, int] = field(default_factory=dict)  # per pool, latest reports


@dataclass
class _Request:
    arrival_s: float
    num_prompt_tokens: int
    num_cached_tokens: int = -1  # unknown until its first event
    num_output_tokens: int = 0
    ready_s: float = 0.0  # its prefill ended: decode may start it
    last_token_s: float = 0.0
    is_ended: bool = False


@dataclass
class _Worker:
    client: object
    worker_id: str
    last_step_s: float | None = None  # its last batch with a step's output


class LoadFeed:
    """The router's ``LoadObserver`` for the planner; ``take`` once per tick."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._requests: dict[str, _Request] = {}
        self._workers: dict[str, _Worker] = {}
        self._generations: dict[str, int] = {}
        self._steps: list[PrefillStep | DecodeStep] = []
        self._last_steps: list[PrefillStep | DecodeStep] = []  # the last window's
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._prompt_tokens = self._cached_tokens = 0
        self._recent_outputs: deque[int] = deque(maxlen=_NUM_RECENT_OUTPUTS)
        # per pool: worker -> (its latest report's waiting requests, when it came)
        self._waiting: dict[str, dict[str, tuple[int, float]]] = {"prefill": {}, "decode": {}}

    # ---- the router's calls (router/observer.py) --------------------------------------
    def arrived(self, request_id: str, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _Request(self.clock(), num_prompt_tokens)

    def ended(self, request_id: str, num_output_tokens: int, num_cached_tokens: int) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        req.is_ended = True
        req.num_output_tokens = max(req.num_output_tokens, num_output_tokens)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached_tokens
        if num_output_tokens > 0:
            self._recent_outputs.append(req.num_output_tokens)

    def batch(self, worker: WorkerView, batch: OutputBatch) -> None:
        now = self.clock()
        role = worker.client.role
        state = self._worker(worker)
        report = batch.report
        self._waiting[role][worker.name] = (report.num_waiting, now)
        if role == "prefill":
            step = self._prefill_step(state, batch, now)
        else:
            step = self._decode_step(state, batch, now)
        if step is not None:
            state.last_step_s = now
            if step.seconds > 0:
                self._steps.append(step)

    def _worker(self, view: WorkerView) -> _Worker:
        state = self._workers.get(view.name)
        if state is None or state.client is not view.client:
            generation = self._generations.get(view.name, -1) + 1
            self._generations[view.name] = generation
            state = _Worker(view.client, f"{view.name}#{generation}")
            self._workers[view.name] = state
        return state

    def _prefill_step(self, state: _Worker, batch: OutputBatch, now: float) -> PrefillStep | None:
        num_tokens, work, started = 0, 0.0, state.last_step_s
        for event in batch.events:
            if not (event.token_ids or event.kv_handles or event.kv_streamed):
                continue
            req = self._requests.get(event.request_id)
            if req is None or req.ready_s:
                continue  # not ours (a peer export), or a migrated request's second prefill
            self._first_token(req, event.num_prompt_tokens, event.num_cached_tokens, now)
            req.num_output_tokens += len(event.token_ids)
            uncached = max(1, req.num_prompt_tokens - req.num_cached_tokens)
            num_tokens += uncached
            work += uncached * uncached / 1000.0
            started = req.arrival_s if started is None else max(started, req.arrival_s)
        if not num_tokens or started is None:
            return None
        return PrefillStep(state.worker_id, now - started, num_tokens, work, end_s=now)

    def _decode_step(self, state: _Worker, batch: OutputBatch, now: float) -> DecodeStep | None:
        num_seqs, kv_tokens, started = 0, 0, state.last_step_s
        for event in batch.events:
            req = self._requests.get(event.request_id)
            if req is None or not event.token_ids:
                continue
            if not req.ready_s:  # aggregated ("full" on this worker): its prefill is here
                self._first_token(req, event.num_prompt_tokens, event.num_cached_tokens, now)
            else:
                gap = (now - req.last_token_s) / len(event.token_ids)
                self._itl.extend([gap] * len(event.token_ids))
                started = req.ready_s if started is None else max(started, req.ready_s)
            num_seqs += 1
            kv_tokens += req.num_prompt_tokens + req.num_output_tokens
            req.num_output_tokens += len(event.token_ids)
            req.last_token_s = now
        if not num_seqs or started is None:
            return None
        return DecodeStep(state.worker_id, now - started, num_seqs, kv_tokens, end_s=now)

    def _first_token(self, req: _Request, num_prompt: int, num_cached: int, now: float) -> None:
        req.ready_s = req.last_token_s = now
        req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
        self._ttft.append(now - req.arrival_s)
        self._prompt_tokens += max(num_prompt, req.num_prompt_tokens)
        self._cached_tokens += req.num_cached_tokens

    def _with_overlap(self) -> tuple[PrefillStep | DecodeStep, ...]:
        """The window's records, each with the share of it the other pool computed (this
        window's records and the last window's, which an early step may overlap)."""
        busy = {
            pool: BusyTimeline(
                (s.end_s - s.seconds, s.end_s)
                for s in (*self._last_steps, *self._steps)
                if isinstance(s, PrefillStep) == (pool == "prefill")
            )
            for pool in ("prefill", "decode")
        }
        out = []
        for step in self._steps:
            other = busy["decode" if isinstance(step, PrefillStep) else "prefill"]
            share = other.share(step.end_s - step.seconds, step.end_s)
            out.append(replace(step, overlap=share))
        self._last_steps = out
        return tuple(out)

    # ---- the planner's call -----------------------------------------------------------
    def take(self, now: float) -> Window:
        """The window ending at ``now``; step and latency records are handed over once."""
        share = self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0
        since = now - self.window_s
        recent = list(self._recent_outputs)
        requests = []
        for index, req in enumerate(r for r in self._requests.values() if r.arrival_s >= since):
            cached = req.num_cached_tokens
            if cached < 0:  # no first token yet: the window's share
                cached = share * req.num_prompt_tokens
            uncached = max(1, int(req.num_prompt_tokens - cached))
            output = req.num_output_tokens
            if not req.is_ended and recent:  # running: a finished one's length, at least
                output = max(output, recent[index % len(recent)])
            requests.append(SimRequest(req.arrival_s, uncached, max(1, output)))
        requests.sort(key=lambda r: r.arrival_s)
        window = Window(
            tuple(requests),
            self._with_overlap(),
            tuple(self._ttft),
            tuple(self._itl),
            share,
            {  # a worker not heard from in the window (retired) no longer counts
                role: sum(n for n, t in workers.values() if t >= since)
                for role, workers in self._waiting.items()
            },
        )
        self._steps, self._ttft, self._itl = [], [], []
        self._prompt_tokens = self._cached_tokens = 0
        self._requests = {
            rid: r
            for rid, r in self._requests.items()
            if r.arrival_s >= since or (not r.is_ended and r.arrival_s >= now - _FORGET_AFTER_S)
        }
        return window
