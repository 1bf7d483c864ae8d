"""One request in flight on its workers: submit it, receive its events, end it there.

The :class:`~router.router.Router` decides where a request goes and hands the prefill
worker's KV handle on to the decode worker; a :class:`Pending` carries the request's
state between those steps: its event queue (filled by the router as worker batches
arrive), the worker that currently owns it, and a prefill worker's handle that no decode
worker has taken yet. :meth:`Pending.settle` runs after the client's stream ended,
whatever ended it, and makes sure the worker side ended too. A worker lost mid-request
raises :class:`~router.migration.WorkerLost` (``router/migration.py``), and
:meth:`Pending.migrated` clears what the lost attempt left before the next.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from router.errors import ErrorCode, RouterError
from router.event_queue import EventQueue, Item
from router.events import GenerateEvent
from router.migration import WorkerLost, died
from router.request_trace import RequestTrace
from router.stream import RequestStream, merge_events
from router.tracing import NO_TRACE
from router.workers import WorkerView, abort_on, decline
from workers.protocol.wire import TokenEvent, WorkItem

logger = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 10.0  # how long an ended request waits for its worker's last event


class Pending:
    """A request in flight: its event queue and who currently owns it."""

    def __init__(self, stream: RequestStream, trace: RequestTrace = NO_TRACE):  # type: ignore[assignment]
        self.stream = stream
        self.trace = trace  # router/tracing.py; NO_TRACE when tracing is off
        self.events = EventQueue()  # the router's intake puts, the stream reads
        self.owner: WorkerView | None = None  # the worker whose final event ends it there
        self.decode: WorkerView | None = None
        self.routed: list[WorkerView] = []  # the workers counting it (WorkerView.expect)
        # A prefill worker's handle that no decode worker took: it must be declined.
        self.unread_handles: tuple[bytes, ...] = ()  # one per prefill rank
        # Layer-wise (router/layerwise.py): a decode worker that holds blocks reserved for
        # the request and has not been given its first token: it must be aborted there.
        self.reserved: WorkerView | None = None
        self.submit: asyncio.Future | None = None  # the last submit call in flight
        self.is_aborted = False
        self.num_migrations = 0
        self.principal = ""  # who sent it (router/auth.py); only they may abort it
        # Server-side deadlines (router.request_timeout_seconds, ..._idle_...): the loop
        # time the request must end by, and the longest wait for a worker's next event.
        self.deadline = math.inf
        self.idle_timeout_s = math.inf

    def migrated(self) -> tuple[bytes, ...]:
        """Router, after a :class:`WorkerLost`: forget the lost attempt before the next.

        Its workers stop counting the request; the events still queued from it (a dead
        worker's failed event is followed by its death notice) are dropped, an Abort's
        wake-up kept in ``is_aborted``. Returns a prefill worker's handle that no decode
        worker took, for the caller to decline.
        """
        request_id = self.stream.request_id
        for view in [*self.routed, *([self.owner] if self.owner else [])]:
            view.end(request_id)
        self.routed.clear()
        self.owner = None
        self.events = EventQueue()  # the router looks the queue up per event
        handles, self.unread_handles = self.unread_handles, ()
        return handles

    def take_reserved(self) -> WorkerView | None:
        """The decode worker that still holds a reservation for the request (to abort)."""
        reserved, self.reserved = self.reserved, None
        return reserved

    async def stream_from(
        self, worker: WorkerView, item: WorkItem
    ) -> AsyncIterator[tuple[GenerateEvent | None, TokenEvent | None]]:
        """Submit ``item`` to ``worker`` and yield (client event, worker event) until the end."""
        stream = self.stream
        role = worker.client.role
        if not worker.is_healthy:
            cause = "submit_failed" if worker.is_alive else died(role)
            raise WorkerLost(worker.name, cause, worker.error or "not healthy")
        self.owner = worker
        worker.active.add(stream.request_id)
        if not stream.stamps.submitted:
            stream.stamps.submitted = time.monotonic()
        # Shielded: a cancel must not race its abort past the submit (a threaded actor
        # does not keep call order); settle waits for this before aborting.
        self.submit = asyncio.ensure_future(worker.client.submit(item))
        if item.kv_handles:
            # Once D (or, for a peer pull, the pulling worker) has the handle, its notice
            # (or expiry) ends the lease: never decline it then, even if this coroutine is
            # cancelled while the submit is in flight.
            def delivered(future: asyncio.Future) -> None:
                if not future.cancelled() and future.exception() is None:
                    self.unread_handles = ()

            self.submit.add_done_callback(delivered)
        try:
            await asyncio.shield(self.submit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            worker.end(stream.request_id)
            self.owner = None
            cause = "submit_failed" if worker.is_alive else died(role)
            raise WorkerLost(worker.name, cause, f"{type(exc).__name__}: {exc}") from None
        while True:
            source, event = await self._next_event()
            if event is None:
                if source == worker.name:  # the worker died
                    raise WorkerLost(worker.name, died(role), worker.error or "gone")
                if source:
                    continue  # a previous owner's death notice
                if self.is_aborted:  # Abort
                    yield stream.abort_event(), None
                    return
                continue
            if source != worker.name:
                if event.spans:  # the previous owner's part of the trace
                    self.trace.worker_spans(event.spans)
                continue  # a late event from the previous owner
            self._on_worker_event(worker, event)  # raises when it failed there
            if event.kv_handles or event.kv_streamed or event.kv_reservations:
                yield None, event  # the hand-off's: the caller goes on with it
                continue
            out = stream.on_event(event)
            # Events that queued behind this one while the client's stream was busy (a
            # router under load) go out with it as one chunk: the generators above and the
            # front end's encoding then run once per chunk, not once per token (vLLM's
            # output collector merges the same way). Idle, nothing is queued: one chunk
            # per engine step, as before.
            if not stream.is_finished and _is_plain(self.events.peek(), worker.name):
                outs = [out] if out is not None else []
                while not stream.is_finished and _is_plain(self.events.peek(), worker.name):
                    event = self.events.get_nowait()[1]
                    assert event is not None  # a plain one
                    self._on_worker_event(worker, event)
                    if (more := stream.on_event(event)) is not None:
                        outs.append(more)
                out = merge_events(outs) if outs else None
            yield out, event
            if stream.is_finished:
                return

    def _on_worker_event(self, worker: WorkerView, event: TokenEvent) -> None:
        """The worker side of one event of ``worker``, the request's current one: its
        trace spans, its counts; WorkerLost or RouterError when the request failed there."""
        stream = self.stream
        if event.spans:  # the worker's part of the trace (its last event there)
            self.trace.worker_spans(event.spans)
        if event.token_ids:
            worker.prefilled(stream.request_id)
        if not event.finished:
            return
        # Its end on this worker (a handle event ends the prefill worker's part).
        worker.end(stream.request_id)
        if not event.kv_handles:
            self.owner = None  # (a kv_streamed one: the decode worker's now)
        if event.error and event.is_retryable:
            # Its engine loop died (the report that says so came with it), or a KV
            # transfer failed: not the request's fault.
            role = worker.client.role
            cause = "transfer_failed" if worker.is_alive else died(role)
            raise WorkerLost(worker.name, cause, event.error)
        if event.error:
            # The worker's text may hold internals (paths, addresses, another request's
            # data): it goes to the log, the client gets an id to quote.
            error_id = uuid.uuid4().hex
            logger.error(
                "request %s failed on worker %s [error %s]: %s",
                stream.request_id,
                worker.name,
                error_id,
                event.error,
            )
            raise RouterError(
                ErrorCode.INTERNAL,
                f"the request failed on a worker (error {error_id}; the server's log has "
                "the details)",
            )

    async def _next_event(self) -> tuple[str, TokenEvent | None]:
        """The next event, within the request's deadlines; DEADLINE_EXCEEDED past them
        (the router then ends the request everywhere, as for an abort)."""
        if self.deadline == math.inf and self.idle_timeout_s == math.inf:
            return await self.events.get()
        left = self.deadline - asyncio.get_running_loop().time()
        wait = min(left, self.idle_timeout_s)
        try:
            return await self.events.get(max(0.0, wait))
        except asyncio.TimeoutError:
            what = (
                "its deadline (router.request_timeout_seconds)"
                if wait == left
                else f"{self.idle_timeout_s:g} s without output (router.request_idle_timeout_seconds)"
            )
            raise RouterError(ErrorCode.DEADLINE_EXCEEDED, f"the request passed {what}") from None

    async def settle(self, decode: Sequence[WorkerView]) -> None:
        """After the client's stream ended: make sure the worker side ended too.

        Declines a handle no decode worker took (through ``decode``), aborts the request on
        its owner unless it ended there, and waits (up to ``SETTLE_TIMEOUT_S``) for the
        owner's final event, so that the id is not reused while a worker still runs it.
        """
        request_id = self.stream.request_id
        # The workers it was routed to but will not run on stop counting it at once; the
        # owner, once its final event came (below) or when the wait gives up.
        for view in self.routed:
            if view is not self.owner:
                view.end(request_id)
        try:
            if self.submit is not None:  # let a submit in flight land before its abort
                await asyncio.wait([self.submit], timeout=SETTLE_TIMEOUT_S)
            reserved = self.take_reserved()
            if reserved is not None and reserved is not self.owner:
                await abort_on(reserved, request_id)  # its blocks were reserved for nothing
            if self.unread_handles:
                await decline(self.unread_handles, self.decode, decode)
            owner = self.owner
            if owner is None or (owner.client.role == "prefill" and self.unread_handles):
                return
            if self.is_aborted or self.stream.is_finished:
                await abort_on(owner, request_id)
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while request_id in owner.active and owner.is_alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("%s: no final event from %s", request_id, owner.name)
                    break
                try:
                    source, event = await self.events.get(left)
                except asyncio.TimeoutError:
                    continue
                if event is not None and event.spans:
                    self.trace.worker_spans(event.spans)
                if source != owner.name or event is None or not event.finished:
                    continue
                owner.end(request_id)
                if event.kv_handles:  # prefill finished before the abort came
                    await decline(event.kv_handles, self.decode, decode)
        finally:
            for view in [*self.routed, *([self.owner] if self.owner else [])]:
                view.end(request_id)


def _is_plain(item: Item | None, worker: str) -> bool:
    """Whether a queued item is a token event of ``worker`` that needs nothing but the
    stream (no hand-off, no failure): one that can join the chunk being sent."""
    if item is None or item[0] != worker:
        return False
    event = item[1]
    return (
        event is not None
        and not event.error
        and not event.kv_handles
        and not event.kv_streamed
        and not event.kv_reservations
    )
