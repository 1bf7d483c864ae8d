"""The router's Prometheus metrics (docs/metrics.md): latency as clients see it, outcomes.

Measured at the front end, around ``Router.generate``: what a client of ``Generate`` (gRPC)
or of ``/v1/completions`` and ``/v1/chat/completions`` (HTTP, one call per choice)
experiences, queueing in the router included. Series carry ``role="router"``, ``model``,
``instance="router"`` and ``frontend`` (``grpc`` | ``http``), except the running gauge,
a family shared with the workers (``baton_num_requests_running{role="router"}``: both
front ends' calls). The node's exporter serves them with the workers' series
(``workers/serving/metrics_node.py``).

Outcomes, one per call:
- ``baton_requests_rejected_total{code}``: refused before any output (INVALID_ARGUMENT,
  RESOURCE_EXHAUSTED past ``router.max_queued_requests``, UNAVAILABLE while draining or
  with no healthy worker);
- ``baton_requests_finished_total{finish_reason}``: ended with a Final (stop, length, abort);
- ``baton_requests_failed_total{code}``: an error after output began, or an INTERNAL one;
- ``baton_requests_aborted_total{reason}``: ``abort`` (a Final with ABORT: the Abort call,
  or a drain past its grace) or ``cancelled`` (the client cancelled or its deadline passed).

And one the router core counts, for both front ends (no ``frontend`` label):
``baton_router_migrations_total{cause}``, requests moved off a lost worker
(``router/migration.py``: ``decode_worker_died``, ``prefill_worker_died``,
``transfer_failed``, ``submit_failed``); and ``baton_router_peer_exports_total{result}``,
the prefixes it asked a worker to export for another to pull (``router/peer_prefix.py``):
``pulled`` (the handles went to the pulling worker), ``timeout``, ``refused``,
``worker_lost``, ``cancelled`` (each of those: recomputed there).
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import Counter, Histogram

from router.errors import ErrorCode
from router.events import Finish, GenerateEvent
from workers.protocol.metrics import LABELS, RUNNING

# Seconds: 1 ms to 80 s (TTFT under load, long generations end to end).
_LATENCY = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Seconds per token: 1 ms to 2.5 s.
_PER_TOKEN = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
# The router's own families are told apart by front end too.
_LABELS = (*LABELS, "frontend")
_REJECTIONS = frozenset(
    {ErrorCode.INVALID_ARGUMENT, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE}
)

TTFT = Histogram(
    "baton_time_to_first_token_seconds",
    "From the Generate call to its first output token",
    _LABELS,
    buckets=_LATENCY,
)
ITL = Histogram(
    "baton_inter_token_latency_seconds",
    "Between successive streamed chunks of a request (a chunk is one engine step's tokens)",
    _LABELS,
    buckets=_PER_TOKEN,
)
TPOT = Histogram(
    "baton_time_per_output_token_seconds",
    "Per request: (end-to-end - time to first token) / (output tokens - 1)",
    _LABELS,
    buckets=_PER_TOKEN,
)
E2E = Histogram(
    "baton_e2e_request_latency_seconds",
    "From the Generate call to its Final",
    _LABELS,
    buckets=_LATENCY,
)
FINISHED = Counter(
    "baton_requests_finished", "Requests ended with a Final", (*_LABELS, "finish_reason")
)
REJECTED = Counter("baton_requests_rejected", "Requests refused at admission", (*_LABELS, "code"))
FAILED = Counter("baton_requests_failed", "Requests ended by an error", (*_LABELS, "code"))
ABORTED = Counter(
    "baton_requests_aborted",
    "Requests aborted or cancelled before their end",
    (*_LABELS, "reason"),
)
PROMPT_TOKENS = Counter("baton_prompt_tokens", "Prompt tokens of finished requests", _LABELS)
GENERATION_TOKENS = Counter("baton_generation_tokens", "Tokens generated (streamed)", _LABELS)
MIGRATIONS = Counter(
    "baton_router_migrations",
    "Requests migrated to another worker after theirs was lost, by cause",
    (*LABELS, "cause"),
)
PEER_EXPORTS = Counter(
    "baton_router_peer_exports",
    "Peer pulls (G4) the router asked another worker to export a prefix for, by result",
    (*LABELS, "result"),
)


# The per-chunk series (generated tokens, inter-token latency) are counted in plain ints
# and go into prometheus_client at most this long after: each of its updates takes a lock
# (and in multiprocess mode writes a file's map), which per streamed token was 13% of the
# router's CPU (bench/RESULTS.md). Every call's end flushes too.
FLUSH_EVERY_S = 0.5


class RouterMetrics:
    """The router's series for one served model; ``call()`` follows one Generate."""

    def __init__(self, model: str, frontend: str = "grpc", instance: str = "router"):
        self.labels = ("router", model, instance, frontend)
        self.running = RUNNING.labels("router", model, instance)
        self.ttft = TTFT.labels(*self.labels)
        self.itl = ITL.labels(*self.labels)
        self.tpot = TPOT.labels(*self.labels)
        self.e2e = E2E.labels(*self.labels)
        self.prompt_tokens = PROMPT_TOKENS.labels(*self.labels)
        self.generation_tokens = GENERATION_TOKENS.labels(*self.labels)
        self.num_tokens = 0  # generated tokens not in ``generation_tokens`` yet
        self.itl_unflushed = Observations(self.itl)
        self.flushed_at = time.monotonic()

    def call(self) -> CallMetrics:
        return CallMetrics(self)

    def flush(self, now: float) -> None:
        """Hand what the calls counted since the last flush to prometheus_client."""
        if self.num_tokens:
            self.generation_tokens.inc(self.num_tokens)
            self.num_tokens = 0
        self.itl_unflushed.flush()
        self.flushed_at = now


class Observations:
    """A histogram's observations kept in plain numbers until ``flush`` adds them to it:
    its buckets and sum as ``Histogram.observe`` would have left them."""

    def __init__(self, histogram: Histogram):
        self.histogram = histogram
        # prometheus_client's own bounds, +Inf last (tests/test_private_apis.py).
        self.bounds = tuple(histogram._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.num = 0

    def observe(self, amount: float) -> None:
        # The first bucket whose bound is >= amount, as Histogram.observe picks it.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount
        self.num += 1

    def flush(self) -> None:
        if not self.num:
            return
        buckets = self.histogram._buckets
        for i, count in enumerate(self.counts):
            if count:
                buckets[i].inc(count)
                self.counts[i] = 0
        self.histogram._sum.inc(self.sum)
        self.sum = 0.0
        self.num = 0


class CallMetrics:
    """One Generate call: feed it every event, then exactly one of the endings."""

    def __init__(self, metrics: RouterMetrics):
        self.m = metrics
        self.started = time.monotonic()
        self.first_token = 0.0
        self.last_chunk = 0.0
        self.num_tokens = 0
        self.is_done = False
        metrics.running.inc()

    def event(self, event: GenerateEvent) -> None:
        n = len(event.delta.token_ids)
        now = time.monotonic()
        m = self.m
        if n:
            if self.num_tokens == 0:
                self.first_token = now
                m.ttft.observe(now - self.started)  # once per call: at once
            else:
                m.itl_unflushed.observe(now - self.last_chunk)
            self.last_chunk = now
            self.num_tokens += n
            m.num_tokens += n
            if now - m.flushed_at >= FLUSH_EVERY_S:
                m.flush(now)
        if event.finish is not None:
            self._final(event.finish, now)

    def _final(self, finish: Finish, now: float) -> None:
        reason = finish.reason
        FINISHED.labels(*self.m.labels, reason).inc()
        if reason == "abort":
            ABORTED.labels(*self.m.labels, "abort").inc()
        self.m.e2e.observe(now - self.started)
        self.m.prompt_tokens.inc(finish.usage.prompt_tokens)
        if self.num_tokens > 1:
            self.m.tpot.observe((now - self.first_token) / (self.num_tokens - 1))
        self._done()

    def error(self, code: ErrorCode) -> None:
        """The call ends with error ``code`` (a RouterError's, or INTERNAL for a bug)."""
        if self.is_done:
            return
        rejected = self.num_tokens == 0 and code in _REJECTIONS
        (REJECTED if rejected else FAILED).labels(*self.m.labels, code.value).inc()
        self._done()

    def closed(self) -> None:
        """The call is over; without a Final or an error, the client went away."""
        if not self.is_done:
            ABORTED.labels(*self.m.labels, "cancelled").inc()
            self._done()

    def _done(self) -> None:
        self.is_done = True
        self.m.running.dec()
        self.m.flush(time.monotonic())
