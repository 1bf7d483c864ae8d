"""What a worker's reports say about the KV it holds: its pool (G1) and the tiers below it
(G2 host, G3 disk).

The pool's block manager and each tier publish the hashes they started / stopped holding
(``drain_events``);
:class:`TierReporter` gathers them between reports and hands the router *events*
(``stored`` / ``removed`` per tier, as NVIDIA Dynamo's KV events) rather than whole hash
sets: a disk tier holds tens of thousands of blocks, and most reports change a few.

The reports that carry events are numbered (``WorkerReport.kv_events_seq``), so the
router sees a gap when one went missing; a *snapshot* (every hash each tier holds) goes
out on a new channel (a router that knows nothing yet) and every ``SNAPSHOT_EVERY_S``,
which heals a receiver that saw a gap without a call back to the worker.

Events are set operations (stored = add, removed = discard), so duplicates are harmless
and only the order within one hash matters: a hash both stored and removed since the
last report is settled by asking the tier (``contains``) what holds now.

A snapshot of a big tier does not go in one frame (the event channel refuses frames over
64 MiB, and a disk tier of small blocks may hold millions): the snapshot report carries
at most ``SNAPSHOT_CHUNK`` hashes per tier, and the rest follow as ``stored`` events of
the next reports, each re-checked with ``contains`` when it is sent, so that a block
removed in between is not announced after its removal.

Everything here runs on the engine loop's thread; the tiers themselves are thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from workers.engine.kv_tiers.tier import KVTier
from workers.protocol.wire import KVEvents, TierStatus

SNAPSHOT_EVERY_S = 30.0
SNAPSHOT_CHUNK = 65536  # hashes per tier per report while a snapshot goes out (~600 KB)


class HasTiers(Protocol):
    """``LLMEngine.kv_tiers`` when a tier is configured."""

    tiers: tuple[KVTier, ...]  # lookup order: host, then disk


class EventSource(Protocol):
    """What events are read from: a tier, or the pool itself (``BlockManager``)."""

    name: str

    def drain_events(self): ...
    def contains(self, block_hash: int) -> bool: ...
    def hashes(self) -> frozenset[int]: ...


def tier_status(tier: KVTier) -> TierStatus:
    """A tier's stats as the report carries them."""
    st = tier.stats()
    return TierStatus(
        name=st.name,
        blocks=st.blocks,
        bytes=st.bytes,
        capacity_blocks=st.capacity_blocks,
        capacity_bytes=st.capacity_blocks * tier.block_bytes,
        hits=st.hits,
        misses=st.misses,
        errors=st.errors,
        onboard_bytes=st.onboard_bytes,
        onboard_seconds=st.onboard_seconds,
        offload_bytes=st.offload_bytes,
        offload_seconds=st.offload_seconds,
        evictions=st.evictions,
        rejected=st.rejected,
    )


class TierReporter:
    """The KV part of one worker's reports: the tiers' latest stats, and numbered events
    of the pool (``pool``: its block manager, event source "pool") and of the tiers."""

    def __init__(self, tiers: Sequence[KVTier], pool: EventSource | None = None):
        self.stat_tiers = tuple(tiers)
        self.sources: tuple[EventSource, ...] = (*((pool,) if pool is not None else ()), *tiers)
        self.seq = 0  # the number of the last report that carried events
        self.status: tuple[TierStatus, ...] = tuple(tier_status(t) for t in self.stat_tiers)
        # Per tier: hashes stored / removed since the last report that carried events.
        self._stored: list[set[int]] = [set() for _ in self.sources]
        self._removed: list[set[int]] = [set() for _ in self.sources]
        self._backlog: list[list[int]] = [[] for _ in self.sources]  # a snapshot's rest
        self._snapshot_due = True  # nobody has heard of these tiers yet
        self._snapshot_at = time.monotonic()

    def refresh(self) -> None:
        """Collect the tiers' events and stats (the engine loop, every few steps)."""
        for i, tier in enumerate(self.sources):
            events = tier.drain_events()
            stored, removed = set(events.stored), set(events.removed)
            for block_hash in stored & removed:  # which came last: the tier knows
                (removed if tier.contains(block_hash) else stored).discard(block_hash)
            self._stored[i] -= removed
            self._stored[i] |= stored
            self._removed[i] -= stored
            self._removed[i] |= removed
        self.status = tuple(tier_status(t) for t in self.stat_tiers)
        if time.monotonic() - self._snapshot_at >= SNAPSHOT_EVERY_S:
            self._snapshot_due = True

    def resend(self) -> None:
        """The next report carries a snapshot (a new receiver knows none of the hashes)."""
        self._snapshot_due = True

    def take_events(self) -> tuple[int, bool, tuple[KVEvents, ...]]:
        """``(seq, snapshot, events)`` for the report being sent; ``events`` empty (and
        ``seq`` the previous report's) when there is nothing new."""
        if self._snapshot_due:
            self._snapshot_due = False
            self._snapshot_at = time.monotonic()
            events = []
            for i, tier in enumerate(self.sources):
                tier.drain_events()  # what they said is in hashes() now (or comes next)
                self._stored[i].clear()
                self._removed[i].clear()
                held = list(tier.hashes())
                self._backlog[i] = held[SNAPSHOT_CHUNK:]
                events.append(KVEvents(tier.name, tuple(held[:SNAPSHOT_CHUNK]), ()))
            self.seq += 1
            return self.seq, True, tuple(events)
        events = []
        for i, tier in enumerate(self.sources):
            if self._backlog[i]:
                chunk = self._backlog[i][:SNAPSHOT_CHUNK]
                del self._backlog[i][:SNAPSHOT_CHUNK]
                held = {h for h in chunk if tier.contains(h)}
                self._removed[i] -= held
                self._stored[i] |= held
            if self._stored[i] or self._removed[i]:
                events.append(KVEvents(tier.name, tuple(self._stored[i]), tuple(self._removed[i])))
                self._stored[i] = set()
                self._removed[i] = set()
        if not events:
            return self.seq, False, ()
        self.seq += 1
        return self.seq, False, tuple(events)
