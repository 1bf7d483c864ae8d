"""The router's side of its workers: the client Protocol and what it last heard from each.

The router never calls Ray itself: ``cluster/`` hands it one :class:`WorkerClient` per
worker (``workers.serving.ray_worker.RayWorkerClient`` in production, in-process services in
tests). Each worker pushes its token events and :class:`~workers.protocol.wire.WorkerReport` to the
router, which dispatches them as they arrive (``Router._on_batch``);
:class:`WorkerView` keeps the latest report and the worker's cached block hashes for the
routing policy, its pool's (G1) and its lower tiers' alike, by applying the reports'
numbered stored / removed events (``WorkerReport.kv_events``; the pool's source is
"pool"). ``abort_on``
and ``decline`` are the two calls the router makes to end a request's work on a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.policy import WorkerState
from workers.protocol.wire import OutputBatch, TokenEvent, WorkerReport, WorkItem

logger = logging.getLogger(__name__)

POOL = "pool"  # the KV events' source name of a worker's own pool (G1)


class WorkerClient(Protocol):
    name: str
    role: str  # prefill | decode

    async def submit(self, item: WorkItem) -> None:
        """Queue a request on the worker; raises when the worker refuses or is gone."""

    async def abort(self, request_id: str) -> None:
        """Abort a request on the worker (its final event follows); unknown ids are ignored."""

    async def decline(self, handles: tuple[bytes, ...]) -> None:
        """Decode workers: release a prefill worker's held KV that will never be read."""

    async def start(self) -> None:
        """Open the worker's event channel; raises when the worker cannot be reached."""

    def listen(
        self, on_batch: Callable[[OutputBatch], None], on_lost: Callable[[str], None]
    ) -> None:
        """Call ``on_batch`` (on the event loop) with each batch of token events and the
        worker's report, and ``on_lost`` once, with why, when the worker is gone."""

    def close(self) -> None:
        """Close the event channel."""


@dataclass(frozen=True)
class Expected:
    """What a request routed to a worker will cost it, counted from the moment of routing."""

    num_prefill_tokens: int  # prompt tokens it will compute there (0 once computed, or
    # for a decode worker fed by a prefill worker)
    num_blocks: int  # KV blocks its prompt takes there


@dataclass
class WorkerView:
    """The router's side of one worker: its last report, and the requests it routed there.

    ``routed`` holds every request from the moment the policy chose this worker until its
    part here ended (its final event, an abort or failure settled, the worker lost);
    ``active`` those of them submitted and not yet finished. A routed request not yet
    active is *incoming*: a decode worker's request still in prefill elsewhere.
    """

    client: WorkerClient
    report: WorkerReport | None = None
    # The hashes the worker's pool (G1) holds, and the tiers' below it (name -> hashes, in
    # the worker's lookup order); kept by applying its events (source "pool" and the
    # tiers'), numbered up to ``kv_events_seq``. After a gap both are empty (the worker
    # counts as holding nothing) until the next snapshot.
    hashes: set[int] = field(default_factory=set)
    tier_hashes: dict[str, set[int]] = field(default_factory=dict)
    kv_events_seq: int = 0
    tiers_in_sync: bool = True
    is_alive: bool = True
    # Being scaled down (router/scaling.py owns it): routed nothing new, still serving what
    # it has (the policy skips it: ``WorkerState.is_draining``).
    is_draining: bool = False
    error: str = ""  # why the worker was declared dead
    active: set[str] = field(default_factory=set)  # request ids sent and not yet finished
    routed: dict[str, Expected] = field(default_factory=dict)
    # With the last report: how many requests were ``active`` and the batch's events.
    # The report's load less those of them it still counted is the other router
    # processes' (``router.processes``; ``num_mine_reported``).
    num_active_at_report: int = 0
    last_events: Sequence[TokenEvent] = ()

    @property
    def name(self) -> str:
        return self.client.name

    def update(self, report: WorkerReport, events: Sequence[TokenEvent] = ()) -> None:
        """A batch came: its report, and ``events`` (this router's requests' only: with
        several router processes each gets its own requests' events, every report)."""
        self._apply_events(report)
        self.report = report
        # Per batch only what is O(1): the count is made when the policy asks (per
        # request, far rarer than batches).
        self.num_active_at_report, self.last_events = len(self.active), events

    @property
    def num_mine_reported(self) -> int:
        """How many of this router's requests the last report counted, as far as it can
        tell: the report was built after the batch's final events, which no longer count
        (a router's channel carries its own requests' events only)."""
        num_ended = sum(1 for e in self.last_events if e.finished)
        return max(0, self.num_active_at_report - num_ended)

    def _apply_events(self, report: WorkerReport) -> None:
        seq = report.kv_events_seq
        if report.kv_events_snapshot:  # the whole truth, whatever came before
            held = {ev.tier: set(ev.stored) for ev in report.kv_events}
            self.hashes = held.pop(POOL, set())
            self.tier_hashes = held
            self.kv_events_seq, self.tiers_in_sync = seq, True
            return
        if seq == self.kv_events_seq or not self.tiers_in_sync:
            return  # nothing new, or waiting for a snapshot
        if seq != self.kv_events_seq + 1:
            # A report with events never arrived (or this is a restarted worker's first
            # after its snapshot was lost): what is known is wrong by an unknown amount.
            logger.warning(
                "%s: KV events %d..%d missing; ignoring its cache until a snapshot",
                self.name,
                self.kv_events_seq + 1,
                seq - 1,
            )
            self.hashes, self.tier_hashes, self.tiers_in_sync = set(), {}, False
            return
        for ev in report.kv_events:
            held = self.hashes if ev.tier == POOL else self.tier_hashes.setdefault(ev.tier, set())
            held.update(ev.stored)
            held.difference_update(ev.removed)
        self.kv_events_seq = seq

    @property
    def is_healthy(self) -> bool:
        return self.is_alive and self.report is not None and self.report.healthy

    @property
    def num_incoming(self) -> int:
        """Requests routed here and not yet submitted here."""
        return sum(1 for rid in self.routed if rid not in self.active)

    def expect(self, request_id: str, expected: Expected) -> None:
        """Router: count ``request_id`` against this worker (it was just routed here)."""
        self.routed[request_id] = expected

    def prefilled(self, request_id: str) -> None:
        """Router: the request's prompt is computed here (its first token came)."""
        expected = self.routed.get(request_id)
        if expected is not None and expected.num_prefill_tokens:
            self.routed[request_id] = Expected(0, expected.num_blocks)

    def end(self, request_id: str) -> None:
        """Router: the request's part on this worker is over (whatever ended it)."""
        self.active.discard(request_id)
        self.routed.pop(request_id, None)

    def forget_all(self) -> None:
        """The worker died or was replaced: nothing routed to it runs there any more."""
        self.active.clear()
        self.routed.clear()
        self.num_active_at_report, self.last_events = 0, ()

    def state(self) -> WorkerState:
        """The policy's view: the worker's report, plus what the router routed since."""
        report = self.report
        incoming = [e for rid, e in self.routed.items() if rid not in self.active]
        submitted = [e for rid, e in self.routed.items() if rid in self.active]
        # The router's own count is fresher than the last report under a burst; the
        # report knows better once it has caught up (blocks grow with the output). With
        # several router processes the report also holds the others' requests: those are
        # the report's load less this router's share of it, and this router's own are
        # counted now (reconciled with every report, at least every HEARTBEAT_S).
        num_waiting = report.num_waiting if report else 0
        num_reported = report.num_running + num_waiting if report else 0
        num_others = max(0, num_reported - self.num_mine_reported)
        num_running = max(
            len(self.active) + num_others - num_waiting, report.num_running if report else 0
        )
        used = max(report.kv_blocks_used if report else 0, sum(e.num_blocks for e in submitted))
        return WorkerState(
            name=self.name,
            healthy=self.is_healthy,
            is_draining=self.is_draining,
            num_running=num_running,
            num_waiting=num_waiting,
            num_incoming=len(incoming),
            num_prefill_tokens=sum(e.num_prefill_tokens for e in self.routed.values()),
            kv_blocks_used=used + sum(e.num_blocks for e in incoming),
            kv_blocks_total=report.kv_blocks_total if report else 0,
            cached_hashes=self.hashes,
            tier_hashes=tuple(self.tier_hashes.items()),
        )


async def abort_on(worker: WorkerView, request_id: str) -> None:
    """Ask ``worker`` to abort the request; a failure is logged (its final never comes,
    and the router's settle deadline ends the wait)."""
    try:
        await worker.client.abort(request_id)
    except Exception:
        logger.warning("abort of %s on %s failed", request_id, worker.name, exc_info=True)


async def decline(
    handles: tuple[bytes, ...], preferred: WorkerView | None, decode: Sequence[WorkerView]
) -> None:
    """Release a prefill worker's held KV that no decode worker will read.

    Any decode worker can send the notice (each knows every prefill worker); when
    none can, the lease expires after ``kv_transfer.lease_seconds``.
    """
    candidates = [preferred] if preferred is not None else []
    candidates += [v for v in decode if v is not preferred]
    for view in candidates:
        if not view.is_alive:
            continue
        try:
            await view.client.decline(handles)
            return
        except Exception:
            logger.warning("decline through %s failed", view.name, exc_info=True)
