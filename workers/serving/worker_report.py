"""What a worker tells the router about itself with every batch it pushes.

The router's policies need each worker's load and its cached block hashes (``kv_aware``);
``baton status`` and the worker's metrics also show its speculative-decoding counters.
Collecting the hashes walks the block manager, so it is done at most every
``HASHES_EVERY_S``, and the set travels only when it changed since the last report sent:
a hash set of thousands of blocks is not re-sent with every token. The tiers below the
pool travel as numbered events instead (``workers/serving/tier_report.py``).
"""

from __future__ import annotations

import time

from workers.engine.llm_engine import LLMEngine
from workers.protocol.wire import WorkerReport
from workers.serving.tier_report import TierReporter

HASHES_EVERY_S = 0.1


class ReportBuilder:
    """Builds a worker's reports; call from the engine loop's thread only."""

    def __init__(self, engine: LLMEngine, name: str, role: str):
        self.engine = engine
        self.name = name
        self.role = role
        self._hashes: frozenset[int] = frozenset()
        self._hashes_tuple: tuple[int, ...] = ()  # what reports carry; rebuilt on change only
        self._version = 0
        self._checked_at = -HASHES_EVERY_S
        self._sent_version = -1  # the hashes version the last report carried
        # engine.kv_tiers: None when no tier is configured (getattr: an engine built
        # before the tiers existed has no such attribute).
        kv_tiers = getattr(engine, "kv_tiers", None)
        self._tiers = TierReporter(kv_tiers.tiers) if kv_tiers is not None else None

    def refresh_hashes(self) -> None:
        """Recompute the cached-hash set if ``HASHES_EVERY_S`` has passed (cheap otherwise)."""
        now = time.monotonic()
        if now - self._checked_at < HASHES_EVERY_S:
            return
        self._checked_at = now
        if self._tiers is not None:
            self._tiers.refresh()
        hashes = frozenset(self.engine.block_manager.cached_block_hashes())
        if hashes != self._hashes:
            self._hashes = hashes
            self._hashes_tuple = tuple(hashes)
            self._version += 1

    def resend_hashes(self) -> None:
        """The next report carries the hashes whether or not they changed, and a snapshot
        of every tier (a new receiver)."""
        self._sent_version = -1
        if self._tiers is not None:
            self._tiers.resend()

    def next(self, healthy: bool, error: str = "") -> WorkerReport:
        """The report to send now; it carries the hashes only if the last one did not."""
        sched, bm = self.engine.scheduler, self.engine.block_manager
        spec = self.engine.spec_stats
        hashes = None if self._version == self._sent_version else self._hashes_tuple
        self._sent_version = self._version
        seq, snapshot, events, status = 0, False, (), ()
        if self._tiers is not None:
            seq, snapshot, events = self._tiers.take_events()
            status = self._tiers.status
        return WorkerReport(
            name=self.name,
            role=self.role,
            healthy=healthy,
            num_running=len(sched.running) + self.engine.num_receiving,
            num_waiting=len(sched.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            num_held=self.engine.num_held,
            hashes_version=self._version,
            cached_hashes=hashes,
            error=error,
            spec_num_steps=spec.num_steps,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            kv_events_seq=seq,
            kv_events_snapshot=snapshot,
            kv_events=events,
            kv_tiers=status,
        )
