"""A worker's sinks, one per router process (workers/serving/sinks.py): a request's events
go to the process that submitted it, every batch's report to all, and a dead process's
requests are handed back to be aborted."""

from __future__ import annotations

from workers.protocol.wire import KVEvents, TokenEvent, WorkerReport
from workers.serving.sinks import REPORT_EVERY_S, Sinks

REPORT = WorkerReport("decode-0", "decode", True, 1, 0, 100, 0, 0, 0)


def event(rid: str, finished: bool = False, handles: tuple[bytes, ...] = ()) -> TokenEvent:
    return TokenEvent(rid, (7,), finished, "length" if finished else None, kv_handles=handles)


def routed(sinks: Sinks, events, report=REPORT, now: float | None = None) -> dict:
    """Which router gets which events; ``now`` by default a second after the last call
    (every sink is due a report then)."""
    if now is None:
        sinks.test_clock = now = getattr(sinks, "test_clock", 0.0) + 1.0
    return {r: [e.request_id for e in mine] for r, _, mine in sinks.split(events, report, now)}


def test_events_go_to_their_router_and_every_router_gets_a_batch():
    sinks = Sinks()
    for router in (0, 1, 2):
        sinks.attach(router, lambda batch: None)
    sinks.own("a", 1)
    sinks.own("b", 2)
    sinks.own("c", 0)
    got = routed(sinks, [event("a"), event("b"), event("c"), event("unknown")])
    assert got == {0: ["c", "unknown"], 1: ["a"], 2: ["b"]}
    assert routed(sinks, []) == {0: [], 1: [], 2: []}  # the report alone, to each


def test_a_final_event_ends_the_ownership():
    sinks = Sinks()
    sinks.attach(0, lambda batch: None)
    sinks.attach(1, lambda batch: None)
    sinks.own("a", 1)
    assert routed(sinks, [event("a", finished=True)]) == {0: [], 1: ["a"]}
    assert routed(sinks, [event("a")]) == {0: ["a"], 1: []}  # a late one: router 0's


def test_a_dropped_router_s_requests_are_handed_back_and_its_late_events_go_to_router_0():
    sinks = Sinks()
    sinks.attach(0, lambda batch: None)
    sinks.attach(1, lambda batch: None)
    sinks.own("a", 1)
    sinks.own("b", 1)
    sinks.own("c", 0)
    assert sorted(sinks.drop(1)) == ["a", "b"]
    assert sinks.drop(0) == []  # router 0's requests are not tracked: its channel says so
    sinks.attach(0, lambda batch: None)
    # A final with KV handles after the drop: router 0 declines them.
    assert routed(sinks, [event("a", True, (b"h",))]) == {0: ["a"]}


def test_a_new_sink_for_a_router_hands_back_the_old_one_s_requests():
    sinks = Sinks()
    sinks.attach(0, lambda batch: None)
    assert sinks.attach(1, lambda batch: None) == []
    sinks.own("a", 1)
    assert sinks.attach(1, lambda batch: None) == ["a"]  # a restarted router process
    assert routed(sinks, [event("a")]) == {0: ["a"], 1: []}


def test_a_report_alone_goes_to_a_process_at_most_every_report_every_s_unless_news():
    sinks = Sinks()
    for router in (0, 1):
        sinks.attach(router, lambda batch: None)
    sinks.own("a", 1)
    assert routed(sinks, [event("a")], now=10.0) == {0: [], 1: ["a"]}
    # Router 0 had its report 10 ms ago at most: only router 1's events go now.
    assert routed(sinks, [event("a")], now=10.0 + REPORT_EVERY_S / 2) == {1: ["a"]}
    assert routed(sinks, [event("a")], now=10.0 + 2 * REPORT_EVERY_S) == {0: [], 1: ["a"]}
    # KV events are numbered (a receiver that misses one sees a gap): to everyone, now.
    news = WorkerReport("decode-0", "decode", True, 1, 0, 100, 0, 0, 0, kv_events_seq=3,
                        kv_events=(KVEvents("pool", (11,), ()),))  # fmt: skip
    assert routed(sinks, [event("a")], news, now=10.0 + 2 * REPORT_EVERY_S) == {0: [], 1: ["a"]}
    dying = WorkerReport("decode-0", "decode", False, 0, 0, 100, 0, 0, 0, error="boom")
    assert routed(sinks, [], dying, now=10.0 + 2 * REPORT_EVERY_S) == {0: [], 1: []}
