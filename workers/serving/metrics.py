"""A worker's Prometheus metrics (docs/metrics.md): load, KV cache, queueing, KV hand-off
(partial receive and peer pull too), speculative decoding, MoE expert load, and the KV
tiers below the pool (``tier_metrics.py``).

Recorded by rank 0 of a replica on its engine loop's thread (``workers/serving/service.py``);
the node's exporter serves them (``workers/serving/metrics_node.py``). Every series carries
``role`` (prefill | decode), ``model`` (the served name) and ``instance`` (the worker's
name, e.g. ``decode-0``). Names follow Prometheus' conventions: a unit suffix, and
``_total`` on counters.

The families are module globals (prometheus-client registers a name once per process);
a :class:`WorkerMetrics` binds their labels for one worker. Its values are created at
construction, so a process records into its node directory only if ``record_into``
ran before.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from workers.engine.request import Request
from workers.protocol.metrics import LABELS, RUNNING
from workers.protocol.wire import WorkerReport
from workers.serving.tier_metrics import TierSeries

# Seconds: 1 ms to 40 s, about x2.5 apart (queueing and transfers span that range).
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 40.0)
# Bytes: 64 KiB to 4 GiB by x4 (one block of a tiny model to a 128k-token prompt).
_BYTES = tuple(float(2**k) for k in range(16, 33, 2))

WAITING = Gauge(
    "baton_num_requests_waiting",
    "Requests waiting for a worker's scheduler",
    LABELS,
    multiprocess_mode="livesum",
)
KV_USAGE = Gauge(
    "baton_kv_cache_usage_ratio",
    "Share of a worker's KV-cache blocks in use (0 to 1; cached free blocks excluded)",
    LABELS,
    multiprocess_mode="livesum",
)
QUEUE_TIME = Histogram(
    "baton_request_queue_time_seconds",
    "From a request's arrival on a worker to its first scheduling there",
    LABELS,
    buckets=_SECONDS,
)
PREFIX_QUERIED = Counter(
    "baton_prefix_cache_queried_tokens",
    "Prompt tokens looked up in the prefix cache (once per request, at first scheduling)",
    LABELS,
)
PREFIX_HITS = Counter(
    "baton_prefix_cache_hit_tokens",
    "Prompt tokens served from the prefix cache instead of computed",
    LABELS,
)
TRANSFER_TIME = Histogram(
    "baton_kv_transfer_seconds",
    "One request's KV hand-off on the decode worker, all ranks, until the last byte",
    LABELS,
    buckets=_SECONDS,
)
TRANSFER_BYTES = Histogram(
    "baton_kv_transfer_bytes",
    "KV bytes one request's hand-off moved (all ranks)",
    LABELS,
    buckets=_BYTES,
)
TRANSFER_FAILURES = Counter(
    "baton_kv_transfer_failures",
    "Failed KV hand-offs: stage=offer (prefill could not lease) or receive (decode)",
    (*LABELS, "stage"),
)
LEASE_EXPIRIES = Counter(
    "baton_kv_lease_expiries",
    "Prefill KV leases that ended unread by their deadline (blocks freed then)",
    LABELS,
)
# Partial receive and peer pull (docs/kv-tiers.md, "Peers (G4) and partial receive"):
# ``source`` is where the blocks came from, ``prefill`` (a hand-off) or ``peer`` (G4).
RECEIVE_BLOCKS = Counter(
    "baton_kv_receive_blocks",
    "Prompt KV blocks a worker asked of another (a prefill worker, or a peer) to receive",
    (*LABELS, "source"),
)
RECEIVE_REUSED_BLOCKS = Counter(
    "baton_kv_receive_reused_blocks",
    "Prompt blocks of received prompts that the worker held already and did not receive",
    (*LABELS, "source"),
)
RECEIVE_SAVED_BYTES = Counter(
    "baton_kv_receive_saved_bytes",
    "KV bytes those held blocks saved the transport (over the receives that succeeded)",
    (*LABELS, "source"),
)
PEER_PULLS = Counter(
    "baton_kv_peer_pulls",
    "Peer pulls (G4) on the pulling worker: received, recomputed (the transfer failed), "
    "or unused (declined: its own cache covered the prefix, or the request ended first)",
    (*LABELS, "result"),
)
# Layer-wise hand-off (docs/kvtransfer.md): counted by the prefill worker when a stream's
# future completes, ``result`` = done (every layer landed) or failed (aborted included).
LAYERWISE_STREAMS = Counter(
    "baton_kv_layerwise_streams",
    "Layer-wise KV streams a prefill worker ended: result=done (every layer written) or failed",
    (*LABELS, "result"),
)
SPEC_STEPS = Counter(
    "baton_spec_decode_verify_steps",
    "Speculative verify steps (one per speculating request per engine step)",
    LABELS,
)
SPEC_DRAFT_TOKENS = Counter(
    "baton_spec_decode_draft_tokens",
    "Tokens proposed by speculative decoding (ngram lookup or draft model)",
    LABELS,
)
SPEC_ACCEPTED_TOKENS = Counter(
    "baton_spec_decode_accepted_tokens",
    "Proposed tokens the target model accepted",
    LABELS,
)

# MoE models (docs/moe.md, "Expert load"): a series per (layer, expert), so a hot expert or
# a skewed layer shows in any Prometheus rate() or ratio.
EXPERT_TOKENS = Counter(
    "baton_moe_expert_tokens",
    "MoE models: (token, slot) pairs routed to each expert of each layer",
    (*LABELS, "layer", "expert"),
)
EXPERT_IMBALANCE = Gauge(
    "baton_moe_expert_load_max_over_mean",
    "MoE models: the busiest expert's pairs over the mean expert's, per layer, since start",
    (*LABELS, "layer"),
)


class WorkerMetrics:
    """One worker's series; call from its engine loop's thread (or any: values lock)."""

    def __init__(self, role: str, model: str, instance: str):
        labels = (role, model, instance)
        self._labels = labels
        self._tiers: dict[str, TierSeries] = {}  # by tier name, made at its first report
        self._running = RUNNING.labels(*labels)
        self._waiting = WAITING.labels(*labels)
        self._kv_usage = KV_USAGE.labels(*labels)
        self._queue_time = QUEUE_TIME.labels(*labels)
        self._queried = PREFIX_QUERIED.labels(*labels)
        self._hits = PREFIX_HITS.labels(*labels)
        self._transfer_time = TRANSFER_TIME.labels(*labels)
        self._transfer_bytes = TRANSFER_BYTES.labels(*labels)
        self._offer_failures = TRANSFER_FAILURES.labels(*labels, "offer")
        self._receive_failures = TRANSFER_FAILURES.labels(*labels, "receive")
        self._expiries = LEASE_EXPIRIES.labels(*labels)
        self._receives = {
            source: tuple(
                family.labels(*labels, source)
                for family in (RECEIVE_BLOCKS, RECEIVE_REUSED_BLOCKS, RECEIVE_SAVED_BYTES)
            )
            for source in ("prefill", "peer")
        }
        self._peer_pulls = {
            result: PEER_PULLS.labels(*labels, result)
            for result in ("received", "recomputed", "unused")
        }
        self._streams = {r: LAYERWISE_STREAMS.labels(*labels, r) for r in ("done", "failed")}
        self._spec_steps = SPEC_STEPS.labels(*labels)
        self._spec_draft = SPEC_DRAFT_TOKENS.labels(*labels)
        self._spec_accepted = SPEC_ACCEPTED_TOKENS.labels(*labels)
        self._spec_seen = (0, 0, 0)  # the last report's cumulative counts
        self._experts_seen: dict[int, tuple[int, ...]] = {}  # layer -> last report's totals

    def first_scheduled(self, req: Request) -> None:
        """The scheduler's hook: ``req`` was scheduled for the first time. Its queue time,
        and its prefix-cache lookup (none for a request whose KV comes from a prefill
        worker: it never looks the cache up)."""
        self._queue_time.observe(max(0.0, req.first_scheduled_time - req.arrival_time))
        if not req.is_remote_prefill:
            self._queried.inc(req.num_prompt_tokens)
            self._hits.inc(req.num_cached_tokens)

    def report(self, report: WorkerReport) -> None:
        """The load a report carries (the router sees the same numbers)."""
        self._running.set(report.num_running)
        self._waiting.set(report.num_waiting)
        total = report.kv_blocks_total
        self._kv_usage.set(report.kv_blocks_used / total if total else 0.0)
        # The report's counts are the engine's totals since it started; this worker's
        # counters (a process of its own, started with the engine) add what is new.
        seen = (
            report.spec_num_steps,
            report.spec_num_draft_tokens,
            report.spec_num_accepted_tokens,
        )
        counters = (self._spec_steps, self._spec_draft, self._spec_accepted)
        for counter, now, before in zip(counters, seen, self._spec_seen, strict=True):
            if now > before:
                counter.inc(now - before)
        self._spec_seen = seen
        for load in report.expert_load:
            self._expert_load(load.layer, load.tokens)
        for status in report.kv_tiers:
            series = self._tiers.get(status.name)
            if series is None:
                series = self._tiers[status.name] = TierSeries(*self._labels, status.name)
            series.update(status)

    def _expert_load(self, layer: int, tokens: tuple[int, ...]) -> None:
        before = self._experts_seen.get(layer, (0,) * len(tokens))
        for expert, (now, was) in enumerate(zip(tokens, before, strict=True)):
            if now > was:
                EXPERT_TOKENS.labels(*self._labels, str(layer), str(expert)).inc(now - was)
        self._experts_seen[layer] = tokens
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        ratio = max(tokens) / mean if mean else 0.0
        EXPERT_IMBALANCE.labels(*self._labels, str(layer)).set(ratio)

    def transferred(self, seconds: float, num_bytes: int) -> None:
        self._transfer_time.observe(seconds)
        self._transfer_bytes.observe(num_bytes)

    def transfer_failed(self, stage: str) -> None:
        (self._offer_failures if stage == "offer" else self._receive_failures).inc()

    def lease_expired(self) -> None:
        self._expiries.inc()

    def receive_started(self, source: str, num_blocks: int, num_reused_blocks: int) -> None:
        """A receive of ``num_blocks`` prompt blocks from ``source`` (prefill | peer)
        started; the prompt's ``num_reused_blocks`` before them were held here already."""
        received, reused, _saved = self._receives[source]
        received.inc(num_blocks)
        reused.inc(num_reused_blocks)

    def receive_saved(self, source: str, num_bytes: int) -> None:
        """A receive from ``source`` succeeded; the held blocks saved ``num_bytes``."""
        self._receives[source][2].inc(num_bytes)

    def stream_ended(self, is_done: bool) -> None:
        """Prefill: a layer-wise stream's future completed (done, or failed/aborted)."""
        self._streams["done" if is_done else "failed"].inc()

    def peer_pull(self, result: str) -> None:
        """A peer pull ended on this worker: ``received``, ``recomputed`` or ``unused``."""
        self._peer_pulls[result].inc()
