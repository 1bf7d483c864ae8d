"""What a worker tells the router about itself with every batch it pushes.

The router's policies need each worker's load and the block hashes it holds (``kv_aware``);
``baton status`` and the worker's metrics also show its speculative-decoding counters.
The hashes travel as numbered events, the pool's (G1, source "pool") and the tiers'
below it alike (``workers/serving/tier_report.py``): the block manager records each hash
it starts or stops holding as it happens (O(1)), and a report carries what changed since
the previous one, never the whole set, except in a snapshot for a new receiver. Nothing
on the step path is O(blocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.engine.llm_engine import LLMEngine
from workers.models.moe import expert_load
from workers.protocol.wire import ExpertLoad, WorkerReport
from workers.serving.tier_report import TierReporter

EVENTS_EVERY_S = 0.1  # the tiers' events and stats are collected at most this often


class ReportBuilder:
    """Builds a worker's reports; call from the engine loop's thread only."""

    def __init__(self, engine: LLMEngine, name: str, role: str):
        self.engine = engine
        self.name = name
        self.role = role
        self._checked_at = -EVENTS_EVERY_S
        # Prefill, layer-wise: the shortest prompt it streams (workers/serving/layerwise_stats.py).
        self.layerwise_min_tokens: Callable[[], int] = lambda: 0
        self._expert_load: tuple[ExpertLoad, ...] = ()  # MoE: taken with the events
        # engine.kv_tiers: None when no tier is configured (getattr: an engine built
        # before the tiers existed has no such attribute).
        kv_tiers = getattr(engine, "kv_tiers", None)
        engine.block_manager.record_events = True
        self._events = TierReporter(
            kv_tiers.tiers if kv_tiers is not None else (), pool=engine.block_manager
        )

    def refresh(self) -> None:
        """Collect the pool's and the tiers' events if ``EVENTS_EVERY_S`` has passed."""
        now = time.monotonic()
        if now - self._checked_at < EVENTS_EVERY_S:
            return
        self._checked_at = now
        self._events.refresh()
        model = getattr(self.engine, "model", None)  # (a test's stand-in engine has none)
        if model is not None:
            self._expert_load = tuple(
                ExpertLoad(layer, tokens) for layer, tokens in expert_load(model)
            )

    def resend(self) -> None:
        """The next report carries a snapshot of the pool and every tier (a new receiver)."""
        self._events.resend()

    def next(self, healthy: bool, error: str = "") -> WorkerReport:
        """The report to send now, with the events since the previous one."""
        sched, bm = self.engine.scheduler, self.engine.block_manager
        spec = self.engine.spec_stats
        seq, snapshot, events = self._events.take_events()
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
            error=error,
            spec_num_steps=spec.num_steps,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            kv_events_seq=seq,
            kv_events_snapshot=snapshot,
            kv_events=events,
            kv_tiers=self._events.status,
            expert_load=self._expert_load,
            layerwise_min_tokens=self.layerwise_min_tokens() if healthy else 0,
        )
