"""Which router process gets which events: a worker's sinks, one per router process.

With ``router.processes: N`` every worker opens one event channel to each router process
(docs/serving.md, "Several router processes"). A request's events go to the process that
submitted it; the reports go to all of them, so that each router sees the whole load and
cache of the worker, whichever process routed the requests. A process with no events in
a batch gets its report alone at most every ``REPORT_EVERY_S``, unless the report has
news every receiver must see (KV events, numbered: a skipped one is a gap; a failure):
a worker stepping fast would otherwise send each process a frame per step with nothing
but the report (measured: 17% of a router's event loop at N=2 before this). Router 0 is the
default: events of an id nobody claimed (a request submitted before the ownership was
known, or an orphan's late final) go there, where the router declines orphaned KV.

Loop thread only (``EngineService``): not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from workers.protocol.wire import TokenEvent, WorkerReport
from workers.serving.commands import Sink

REPORT_EVERY_S = 0.01  # a report alone, without news, to a process at most this often


class Sinks:
    def __init__(self) -> None:
        self._sinks: dict[int, Sink] = {}
        # Router processes other than 0 only: the common case (one process) stores nothing.
        self._owner: dict[str, int] = {}
        self._reported_at: dict[int, float] = {}  # router -> when its last batch went

    def __bool__(self) -> bool:
        return bool(self._sinks)

    def attach(self, router: int, sink: Sink) -> list[str]:
        """``sink`` replaces router ``router``'s previous one; returns the ids of the
        requests the previous one submitted, which the loop aborts (a restarted router
        process knows none of them)."""
        orphans = self.drop(router) if router in self._sinks else []
        self._sinks[router] = sink
        return orphans

    def own(self, request_id: str, router: int) -> None:
        """Router ``router`` submitted ``request_id``: its events go there until its final."""
        if router:
            self._owner[request_id] = router
        else:
            self._owner.pop(request_id, None)

    def drop(self, router: int) -> list[str]:
        """Router ``router``'s sink failed: forget it; returns the ids of its requests,
        which the loop aborts (their final events go nowhere)."""
        self._sinks.pop(router, None)
        self._reported_at.pop(router, None)
        if router == 0:
            return []  # router 0's requests are not tracked here; its channel's end says so
        orphans = [rid for rid, owner in self._owner.items() if owner == router]
        for rid in orphans:
            del self._owner[rid]
        return orphans

    def split(
        self, events: Sequence[TokenEvent], report: WorkerReport, now: float
    ) -> Iterator[tuple[int, Sink, tuple]]:
        """(router, sink, its events) for the sinks to send this batch to, in router
        order: those with events of their own, and the others when ``report`` has news
        or their last batch is ``REPORT_EVERY_S`` old."""
        if len(self._sinks) == 1 and not self._owner:  # one router process: no sorting
            ((router, sink),) = self._sinks.items()
            yield router, sink, tuple(events)
            return
        mine: dict[int, list[TokenEvent]] = {router: [] for router in self._sinks}
        for event in events:
            router = self._owner.get(event.request_id, 0)
            if event.finished and router:
                del self._owner[event.request_id]
            if router not in mine:
                # Its router died: router 0 frees what it holds (a final event's KV
                # handles are declined there), and ignores the rest.
                router = 0
            if router in mine:
                mine[router].append(event)
        is_news = bool(report.kv_events or report.kv_events_snapshot or report.error)
        is_news = is_news or not report.healthy
        for router in sorted(self._sinks):
            last = self._reported_at.get(router, -REPORT_EVERY_S)
            if not (mine[router] or is_news) and now - last < REPORT_EVERY_S:
                continue
            self._reported_at[router] = now
            yield router, self._sinks[router], tuple(mine[router])
