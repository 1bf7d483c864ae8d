"""A worker's Prometheus series of its KV tiers below the pool (docs/metrics.md, "KV tiers").

Every series carries the worker's ``role``, ``model`` and ``instance`` and the ``tier``
(``host`` | ``disk``). They follow the report's :class:`~workers.protocol.wire.TierStatus`
(the engine's ``TierStats``): gauges take its current values, counters add what grew
since the previous report (the stats are totals since the engine started, and so is this
worker process's counter).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from workers.protocol.metrics import LABELS
from workers.protocol.wire import TierStatus

_TIER_LABELS = (*LABELS, "tier")


def _gauge(name: str, doc: str) -> Gauge:
    return Gauge(name, doc, _TIER_LABELS, multiprocess_mode="livesum")


BLOCKS = _gauge("baton_kv_tier_blocks", "KV blocks a tier below the pool holds")
BYTES = _gauge("baton_kv_tier_bytes", "Bytes a tier below the pool holds")
CAPACITY = _gauge("baton_kv_tier_capacity_bytes", "Most bytes a tier below the pool may hold")
HITS = Counter("baton_kv_tier_hits", "Block lookups a tier answered with the block", _TIER_LABELS)
MISSES = Counter(
    "baton_kv_tier_misses",
    "Block lookups a tier could not answer (absent or unusable; errors included)",
    _TIER_LABELS,
)
ERRORS = Counter(
    "baton_kv_tier_errors",
    "Blocks a tier found unusable (bad checksum, truncated, I/O error): served as misses",
    _TIER_LABELS,
)
ONBOARD_BYTES = Counter(
    "baton_kv_tier_onboard_bytes", "Bytes read out of a tier into the pool", _TIER_LABELS
)
ONBOARD_SECONDS = Counter(
    "baton_kv_tier_onboard_seconds", "Time spent reading blocks out of a tier", _TIER_LABELS
)
OFFLOAD_BYTES = Counter(
    "baton_kv_tier_offload_bytes", "Bytes written down into a tier", _TIER_LABELS
)
OFFLOAD_SECONDS = Counter(
    "baton_kv_tier_offload_seconds", "Time spent writing blocks into a tier", _TIER_LABELS
)
EVICTIONS = Counter("baton_kv_tier_evictions", "Blocks a tier dropped to make room", _TIER_LABELS)
REJECTED = Counter(
    "baton_kv_tier_rejected_offloads",
    "Blocks a tier refused to store (full disk, an I/O error): offload stops, serving goes on",
    _TIER_LABELS,
)
# TierStatus field -> its counter (prometheus-client adds ``_total`` to each name).
COUNTERS = {
    "hits": HITS,
    "misses": MISSES,
    "errors": ERRORS,
    "onboard_bytes": ONBOARD_BYTES,
    "onboard_seconds": ONBOARD_SECONDS,
    "offload_bytes": OFFLOAD_BYTES,
    "offload_seconds": OFFLOAD_SECONDS,
    "evictions": EVICTIONS,
    "rejected": REJECTED,
}


class TierSeries:
    """One tier's series of one worker."""

    def __init__(self, role: str, model: str, instance: str, tier: str):
        labels = (role, model, instance, tier)
        self._blocks = BLOCKS.labels(*labels)
        self._bytes = BYTES.labels(*labels)
        self._capacity = CAPACITY.labels(*labels)
        self._counters = {name: family.labels(*labels) for name, family in COUNTERS.items()}
        self._seen = dict.fromkeys(COUNTERS, 0.0)  # the previous report's totals

    def update(self, status: TierStatus) -> None:
        self._blocks.set(status.blocks)
        self._bytes.set(status.bytes)
        self._capacity.set(status.capacity_bytes)
        for name, counter in self._counters.items():
            now = getattr(status, name)
            if now > self._seen[name]:
                counter.inc(now - self._seen[name])
            self._seen[name] = now
