"""The KV tiers in a worker's reports (workers/serving/tier_report.py): numbered stored /
removed events that, applied in order, rebuild exactly what each tier holds; snapshots
on a new channel; stats; and the wire round trip."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import torch

from workers.engine.block_manager import BlockManager
from workers.engine.kv_tiers.tier import TierEvents, TierStats
from workers.protocol.wire import KVEvents, OutputBatch, decode_as, encode
from workers.serving import tier_report
from workers.serving.tier_report import TierReporter
from workers.serving.worker_report import ReportBuilder


class ListTier:
    """A tier of the KVTier protocol that holds hashes only (the bytes do not matter to
    the reports), with an event log like the real tiers'."""

    def __init__(self, name: str, capacity: int, block_bytes: int = 64):
        self.name, self.block_bytes, self.capacity = name, block_bytes, capacity
        self._held: dict[int, None] = {}  # insertion order = LRU order
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._held

    def get(self, block_hash: int, out: torch.Tensor) -> bool:
        found = block_hash in self._held
        self.hits += found
        self.misses += not found
        return found

    def put(self, block_hash: int, data: torch.Tensor | None = None) -> bool:
        with self._lock:
            if block_hash in self._held:
                return True
            if len(self._held) >= self.capacity:
                old = next(iter(self._held))
                del self._held[old]
                self._removed.append(old)
                self.evictions += 1
            self._held[block_hash] = None
            self._stored.append(block_hash)
            return True

    def remove(self, block_hash: int) -> None:
        with self._lock:
            if self._held.pop(block_hash, 0) is None:
                self._removed.append(block_hash)

    def hashes(self) -> frozenset[int]:
        return frozenset(self._held)

    def drain_events(self) -> TierEvents:
        with self._lock:
            events = TierEvents(tuple(self._stored), tuple(self._removed))
            self._stored, self._removed = [], []
            return events

    def stats(self) -> TierStats:
        n = len(self._held)
        return TierStats(
            self.name, n, n * self.block_bytes, self.capacity, self.hits, self.misses,
            evictions=self.evictions, offload_bytes=7 * self.block_bytes,
        )  # fmt: skip

    def close(self) -> None:
        pass


def apply(known: dict[str, set[int]], seq: int, snapshot: bool, events) -> None:
    """What a receiver does with a report's tier events."""
    if snapshot:
        known.clear()
    for ev in events:
        held = known.setdefault(ev.tier, set())
        held |= set(ev.stored)
        held -= set(ev.removed)


def test_events_applied_in_order_rebuild_every_tier_exactly():
    rng = random.Random(7)
    host, disk = ListTier("host", 12), ListTier("disk", 40)
    reporter = TierReporter([host, disk])
    known: dict[str, set[int]] = {}
    last_seq = 0
    for step in range(400):
        for _ in range(rng.randrange(4)):
            tier = rng.choice([host, disk])
            if rng.random() < 0.7:
                tier.put(rng.randrange(60))
            else:
                tier.remove(rng.randrange(60))
        if step % 3 == 0:
            reporter.refresh()
        if step % 5 == 0:
            seq, snapshot, events = reporter.take_events()
            assert seq == last_seq + (1 if events else 0)  # only reports with events count
            last_seq = seq
            apply(known, seq, snapshot, events)
    reporter.refresh()
    apply(known, *reporter.take_events())
    assert known == {"host": set(host.hashes()), "disk": set(disk.hashes())}
    assert host.evictions > 0 and disk.evictions > 0  # the test did exercise removal


def test_a_hash_stored_and_removed_between_reports_ends_as_the_tier_holds_it():
    host = ListTier("host", 4)
    reporter = TierReporter([host])
    apply({}, *reporter.take_events())  # the first report: a snapshot
    host.put(1)
    host.remove(1)
    host.put(2)
    host.remove(2)
    host.put(2)  # removed, then stored again: held
    reporter.refresh()
    _, snapshot, (events,) = reporter.take_events()
    assert not snapshot
    assert 2 in events.stored and 2 not in events.removed
    assert 1 in events.removed and 1 not in events.stored


def test_the_first_report_and_a_resend_carry_a_snapshot_and_nothing_new_keeps_the_seq():
    host = ListTier("host", 8)
    for h in (5, 6, 7):
        host.put(h)
    reporter = TierReporter([host])
    seq, snapshot, events = reporter.take_events()
    assert (seq, snapshot) == (1, True) and set(events[0].stored) == {5, 6, 7}
    reporter.refresh()  # the events of those puts are in the snapshot already
    assert reporter.take_events() == (1, False, ())
    host.put(8)
    reporter.resend()  # a new channel
    seq, snapshot, events = reporter.take_events()
    assert (seq, snapshot) == (2, True) and set(events[0].stored) == {5, 6, 7, 8}
    reporter.refresh()
    assert reporter.take_events() == (2, False, ())


def test_a_big_snapshot_goes_out_in_chunks_that_skip_blocks_removed_meanwhile(monkeypatch):
    monkeypatch.setattr(tier_report, "SNAPSHOT_CHUNK", 10)
    disk = ListTier("disk", 100)
    for h in range(35):
        disk.put(h)
    reporter = TierReporter([disk])
    reporter.refresh()
    known: dict[str, set[int]] = {}
    seq, snapshot, (events,) = reporter.take_events()
    assert snapshot and len(events.stored) == 10
    apply(known, seq, snapshot, (events,))
    sizes = []
    removed = 0
    for step in range(5):
        if step < 3:  # meanwhile blocks come and go, some of them in the part not sent yet
            disk.remove(removed)
            disk.remove(34 - removed)
            disk.put(100 + removed)
            removed += 1
        reporter.refresh()
        seq, snapshot, events = reporter.take_events()
        if not events:
            break
        assert not snapshot and len(events) == 1
        sizes.append(len(events[0].stored))
        apply(known, seq, snapshot, events)
    # Three more chunks (the last three of them less what was removed), each with the
    # block stored meanwhile, then nothing.
    assert len(sizes) == 3 and max(sizes) <= 10 + 1
    assert known == {"disk": set(disk.hashes())}


def _engine(kv_tiers) -> SimpleNamespace:
    return SimpleNamespace(
        scheduler=SimpleNamespace(running=[], waiting=[]),
        block_manager=BlockManager(16, 4),
        spec_stats=SimpleNamespace(num_steps=0, num_draft_tokens=0, num_accepted_tokens=0),
        num_receiving=0,
        num_held=0,
        kv_tiers=kv_tiers,
    )


def test_reports_carry_the_tiers_over_the_wire():
    host, disk = ListTier("host", 8, block_bytes=128), ListTier("disk", 32, block_bytes=128)
    host.put(3)
    builder = ReportBuilder(_engine(SimpleNamespace(tiers=(host, disk))), "decode-0", "decode")
    builder.refresh()
    first = decode_as(encode(OutputBatch((), builder.next(healthy=True))), OutputBatch).report
    assert first.kv_events_snapshot and first.kv_events_seq == 1
    assert [(e.tier, e.stored) for e in first.kv_events] == [
        ("pool", ()),
        ("host", (3,)),
        ("disk", ()),
    ]
    assert [t.name for t in first.kv_tiers] == ["host", "disk"]
    status = first.kv_tiers[0]
    assert (status.blocks, status.bytes, status.capacity_blocks) == (1, 128, 8)
    assert status.capacity_bytes == 8 * 128 and status.offload_bytes == 7 * 128
    disk.put(9)
    builder._checked_at = -1.0  # the next refresh is due now
    builder.refresh()
    second = decode_as(encode(OutputBatch((), builder.next(healthy=True))), OutputBatch).report
    assert not second.kv_events_snapshot and second.kv_events_seq == 2
    assert [(e.tier, e.stored, e.removed) for e in second.kv_events] == [("disk", (9,), ())]


def test_a_worker_without_tiers_reports_its_pool_only():
    engine = _engine(None)
    builder = ReportBuilder(engine, "prefill-0", "prefill")
    report = builder.next(healthy=True)  # the snapshot: the pool, empty so far
    assert (report.kv_events_seq, report.kv_events, report.kv_tiers) == (
        1,
        (KVEvents("pool", (), ()),),
        (),
    )
    assert builder.next(healthy=True).kv_events == ()  # nothing new: no events
    bm = engine.block_manager
    assert bm.allocate_slots("r", 0, 8)
    bm.commit_computed("r", list(range(8)), 8)  # two full blocks: two hashes
    builder._checked_at = -1.0
    builder.refresh()
    stored = builder.next(healthy=True)
    assert stored.kv_events_seq == 2 and not stored.kv_events_snapshot
    (event,) = stored.kv_events
    assert event.tier == "pool" and set(event.stored) == bm.hashes() and len(event.stored) == 2
    bm.free("r")
    bm.evict()  # the cached blocks go: their hashes are removed
    builder._checked_at = -1.0
    builder.refresh()
    (gone,) = builder.next(healthy=True).kv_events
    assert gone.tier == "pool" and set(gone.removed) == set(event.stored) and not gone.stored


def test_a_snapshot_also_goes_out_every_snapshot_every_s(monkeypatch):
    host = ListTier("host", 8)
    reporter = TierReporter([host])
    assert reporter.take_events()[1]  # the first
    host.put(1)
    reporter.refresh()
    assert reporter.take_events() == (2, False, (KVEvents("host", (1,), ()),))
    monkeypatch.setattr(tier_report, "SNAPSHOT_EVERY_S", 0.0)  # the period has passed
    host.put(2)
    reporter.refresh()
    seq, snapshot, events = reporter.take_events()
    assert (seq, snapshot) == (3, True) and set(events[0].stored) == {1, 2}
