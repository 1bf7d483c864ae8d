"""What one request holds on the workers, and how it is given back: the ledger of its life.

A request in flight is counted by the workers it was routed to (``WorkerView.routed``:
the policy's view of their load), is *active* on the worker it was submitted to, may leave
a prefill worker's KV held under a lease that no decode worker has taken (the handle must
be declined), and, layer-wise, a decode worker's blocks reserved for it (they must be
aborted there). :class:`Holdings` keeps these for one request and is the only code that
takes or gives them back. When to do which is the request's state machine's
(:class:`~router.lifecycle.RequestLife`): it submits through :meth:`Holdings.submit`,
reports each event of its current worker to :meth:`Holdings.on_event`, drops a lost
attempt with :meth:`Holdings.forget_attempt`, and at the end calls
:meth:`Holdings.end_on_workers` then :meth:`Holdings.release`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from functools import partial

from router.inbox import Inbox, WorkerEvent
from router.migration import WorkerLost, died, failure
from router.request_trace import RequestTrace
from router.workers import WorkerView, abort_on, decline
from workers.protocol.wire import TokenEvent, WorkItem

logger = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 10.0  # how long an ended request waits for its worker's last event


class Holdings:
    """One request's share of its workers (see the module docstring)."""

    def __init__(self, request_id: str, inbox: Inbox, trace: RequestTrace):
        self.request_id = request_id
        self.inbox = inbox  # read here only while the request ends (its final events)
        self.trace = trace
        self.routed: list[WorkerView] = []  # the workers counting it (WorkerView.expect)
        self.decode: WorkerView | None = None  # the attempt's decode worker
        self.owner: WorkerView | None = None  # the worker whose final event is still due
        # A prefill worker's handle that no decode worker took: it must be declined.
        self.unread_handles: tuple[bytes, ...] = ()  # one per prefill rank
        # Layer-wise: a decode worker holding blocks reserved for the request, not yet
        # given its first token: it must be aborted there.
        self.reserved: WorkerView | None = None
        self.submit_call: asyncio.Future | None = None  # the last submit call in flight
        self._prefilled: WorkerView | None = None  # told its prompt is computed (once)

    def counted(self, workers: list[WorkerView], decode: WorkerView) -> None:
        """The attempt's workers now count the request (``attempt.expect`` counted it)."""
        self.routed, self.decode = workers, decode

    async def submit(self, worker: WorkerView, item: WorkItem) -> None:
        """Send ``item`` to ``worker``, the request's owner from now on; WorkerLost when it
        cannot take it (unhealthy, or the call failed)."""
        role = worker.client.role
        if not worker.is_healthy:
            cause = "submit_failed" if worker.is_alive else died(role)
            raise WorkerLost(worker.name, cause, worker.error or "not healthy")
        self.owner = worker
        worker.active.add(self.request_id)
        # Shielded: a cancel must not race its abort past the submit (a threaded actor
        # does not keep call order); ``end_on_workers`` waits for this before aborting.
        self.submit_call = call = asyncio.ensure_future(worker.client.submit(item))
        if item.kv_handles:
            # Once D (or, for a peer pull, the pulling worker) has the handle, its notice
            # (or expiry) ends the lease: never decline it then, even if the stream is
            # cancelled while the submit is in flight.
            call.add_done_callback(partial(_delivered, self))
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            worker.end(self.request_id)
            self.owner = None
            cause = "submit_failed" if worker.is_alive else died(role)
            raise WorkerLost(worker.name, cause, f"{type(exc).__name__}: {exc}") from None

    def on_event(self, worker: WorkerView, event: TokenEvent) -> None:
        """One event of the request's current ``worker``: its trace spans, its counts;
        WorkerLost or RouterError when the request failed there."""
        if event.spans:  # the worker's part of the trace (its last event there)
            self.trace.worker_spans(event.spans)
        if event.token_ids and worker is not self._prefilled:  # its first token there
            worker.prefilled(self.request_id)
            self._prefilled = worker
        if not event.finished:
            return
        # Its end on this worker (a handle event ends the prefill worker's part).
        worker.end(self.request_id)
        if not event.kv_handles:
            self.owner = None  # (a kv_streamed one: the decode worker's next)
        failed = failure(self.request_id, worker.name, worker.client.role, worker.is_alive, event)
        if failed is not None:
            raise failed

    def forget_attempt(self) -> tuple[bytes, ...]:
        """A lost attempt: its workers stop counting the request. Returns a prefill
        worker's handle that no decode worker took, for the caller to decline."""
        self._uncount()
        self.routed, self.owner, self._prefilled = [], None, None
        handles, self.unread_handles = self.unread_handles, ()
        return handles

    async def release_reservation(self) -> None:
        """Layer-wise, P lost after D reserved: abort the reservation there and wait (up to
        ``SETTLE_TIMEOUT_S``) for its end, so that the id is free there for the next try."""
        decode, self.reserved = self.reserved, None
        if decode is None:
            return
        await abort_on(decode, self.request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT_S
        while decode.is_alive and self.request_id in decode.active:
            try:
                item = await self.inbox.get(max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                return
            if type(item) is WorkerEvent and item.worker == decode.name and item.event.finished:
                decode.end(self.request_id)

    async def end_on_workers(self, must_abort: bool, decode_pool: Sequence[WorkerView]) -> None:
        """After the client's stream ended: make sure the worker side ended too.

        The workers it was routed to but will not run on stop counting it at once;
        declines a handle no decode worker took (through ``decode_pool``), aborts a
        layer-wise reservation, aborts the request on its owner when ``must_abort`` (its
        output ended before the worker's), and waits (up to ``SETTLE_TIMEOUT_S``) for the
        owner's final event, so that the id is not reused while a worker still runs it.
        """
        request_id = self.request_id
        for view in self.routed:
            if view is not self.owner:
                view.end(request_id)
        if self.submit_call is not None:  # let a submit in flight land before its abort
            await asyncio.wait([self.submit_call], timeout=SETTLE_TIMEOUT_S)
        reserved, self.reserved = self.reserved, None
        if reserved is not None and reserved is not self.owner:
            await abort_on(reserved, request_id)  # its blocks were reserved for nothing
        if self.unread_handles:
            await decline(self.unread_handles, self.decode, decode_pool)
        owner = self.owner
        if owner is None or (owner.client.role == "prefill" and self.unread_handles):
            return
        if must_abort:
            await abort_on(owner, request_id)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while request_id in owner.active and owner.is_alive:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("%s: no final event from %s", request_id, owner.name)
                break
            try:
                item = await self.inbox.get(left)
            except asyncio.TimeoutError:
                continue
            if type(item) is not WorkerEvent:
                continue
            event = item.event
            if event.spans:
                self.trace.worker_spans(event.spans)
            if item.worker != owner.name or not event.finished:
                continue
            owner.end(request_id)
            if event.kv_handles:  # prefill finished before the abort came
                await decline(event.kv_handles, self.decode, decode_pool)

    def release(self) -> None:
        """Last: no worker counts the request any more (whatever the waits above gave up on)."""
        self._uncount()

    def _uncount(self) -> None:
        for view in [*self.routed, *([self.owner] if self.owner else [])]:
            view.end(self.request_id)


def _delivered(holdings: Holdings, future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        holdings.unread_handles = ()
