"""Leases: released exactly once, by the last reader's notice or by expiry, never mid-write."""

from __future__ import annotations

from kvtransfer.leases import LeaseTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_table():
    released: list[tuple[str, str]] = []
    clock = FakeClock()
    table = LeaseTable(lambda req_id, reason: released.append((req_id, reason)), clock)
    return table, released, clock


def test_last_reader_releases_and_late_notices_are_harmless():
    table, released, _ = make_table()
    lease = table.add("a", (1, 2), num_readers=2, lease_seconds=30)
    assert not table.reader_finished(lease.lease_id, "d0", "done")
    assert not table.reader_finished(lease.lease_id, "d0", "done")  # duplicate
    assert released == []
    assert table.reader_finished(lease.lease_id, "d1", "aborted")
    assert released == [("a", "aborted")] and len(table) == 0
    assert not table.reader_finished(lease.lease_id, "d1", "done")  # late
    assert not table.reader_finished(999, "d1", "done")  # unknown
    assert released == [("a", "aborted")]


def test_expiry_frees_and_no_readers_frees_at_once():
    table, released, clock = make_table()
    table.add("a", (1,), 1, lease_seconds=30)
    table.add("b", (2,), 1, lease_seconds=60)
    table.add("c", (3,), 0, lease_seconds=60)
    assert released == [("c", "no_readers")]
    clock.now += 29.9
    assert table.expire() == []
    clock.now += 0.2
    assert table.expire() == ["a"]
    assert table.next_expiry() == 160.0
    clock.now += 31
    assert table.expire() == ["b"]
    assert released == [("c", "no_readers"), ("a", "expired"), ("b", "expired")]


def test_expiry_waits_for_a_write_in_flight():
    table, released, clock = make_table()
    lease = table.add("a", (1,), 2, lease_seconds=30)
    table.write_started(lease.lease_id)
    clock.now += 40
    assert table.expire() == [] and released == []
    table.write_ended(lease.lease_id, "d0", "done")  # one of two readers served, lease over
    assert released == [("a", "expired")]


def test_write_completion_counts_its_reader():
    table, released, _ = make_table()
    lease = table.add("a", (1,), 1, lease_seconds=30)
    table.write_started(lease.lease_id)
    table.reader_finished(lease.lease_id, "d0", "aborted")  # notice while writing
    assert released == []
    table.write_ended(lease.lease_id, "d0", "aborted")
    assert released == [("a", "aborted")]
    table.release_all("shutdown")
    assert len(released) == 1
