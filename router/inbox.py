"""One request's inbox at the router: what happens to it, in arrival order, as typed items.

Three things reach a request from outside its own stream, each its own type:

- :class:`WorkerEvent`: a worker's token event of the request (``Router._on_batch``);
- :class:`WorkerGone`: a worker it was sent to is lost (died, or its requests migrate
  away: ``Router._evict``);
- :data:`ABORT`: a client's or the drain's abort (``Router.abort_here``).

Whether a worker's event or loss concerns the request *now* (its current worker's) or is
a late word from one it left (a finished prefill worker, a lost attempt) is not the
inbox's business: the request's :class:`~router.lifecycle.RequestLife` judges it by its
state. It is the only reader.

Not an ``asyncio.Queue``: a request has one reader and no bound, so a deque and one
waiter future do, at about half the cost per event (the queue's per-event bookkeeping
was 4% of the router's CPU per streamed token, bench/RESULTS.md). The reader can also
see what is queued (``queued``) and take it at once: events that piled up while the
client's stream was busy go out as one chunk. A deadline is a timer on the waiter, not
``asyncio.wait_for``'s task per event.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NamedTuple

from router.errors import ErrorCode, RouterError
from workers.protocol.wire import TokenEvent


class WorkerEvent(NamedTuple):
    """A token event of the request from worker ``worker``."""

    worker: str
    event: TokenEvent


class WorkerGone(NamedTuple):
    """Worker ``worker`` is lost to the request (dead, or migrated away from)."""

    worker: str


class AbortAsked:
    """The request is to end with ``Finish(abort)``; :data:`ABORT` is the one instance."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABORT"


ABORT = AbortAsked()
Item = WorkerEvent | WorkerGone | AbortAsked
_new_tuple = tuple.__new__


class Inbox:
    """FIFO of one request's items; one reader at a time."""

    __slots__ = ("_waiter", "queued")

    def __init__(self) -> None:
        # What is queued, oldest first. The reader may test and pop it directly (its
        # per-token path: a deque's own C calls, not this class's Python methods).
        self.queued: deque[Item] = deque()
        self._waiter: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self.queued)

    def put(self, item: Item) -> None:
        """Router side: queue ``item`` and wake the reader."""
        self.queued.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def put_event(self, worker: str, event: TokenEvent) -> None:
        """Router side: ``put(WorkerEvent(worker, event))``, the intake's call per event
        (built without the NamedTuple's Python-level constructor: a third of its cost)."""
        self.queued.append(_new_tuple(WorkerEvent, (worker, event)))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        """Drop what is queued (a lost attempt's leftovers, before the next attempt)."""
        self.queued.clear()

    async def get(self, timeout: float | None = None) -> Item:
        """The next item, waiting for one; ``asyncio.TimeoutError`` after ``timeout`` s."""
        if self.queued:
            return self.queued.popleft()
        loop = asyncio.get_running_loop()
        timer = None
        if timeout is not None:
            timer = loop.call_later(max(0.0, timeout), _expire, self)
        try:
            while not self.queued:
                self._waiter = loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        except asyncio.TimeoutError:
            if not self.queued:
                raise
        finally:
            if timer is not None:
                timer.cancel()
        return self.queued.popleft()

    async def get_within(self, deadline: float, idle_timeout_s: float) -> Item:
        """The next item, by loop time ``deadline`` and within ``idle_timeout_s``
        (router.request_timeout_seconds, ..._idle_...); DEADLINE_EXCEEDED past either."""
        left = deadline - asyncio.get_running_loop().time()
        wait = min(left, idle_timeout_s)
        try:
            return await self.get(max(0.0, wait))
        except asyncio.TimeoutError:
            what = (
                "its deadline (router.request_timeout_seconds)"
                if wait == left
                else f"{idle_timeout_s:g} s without output (router.request_idle_timeout_seconds)"
            )
            raise RouterError(ErrorCode.DEADLINE_EXCEEDED, f"the request passed {what}") from None


def _expire(inbox: Inbox) -> None:
    waiter = inbox._waiter
    if waiter is not None and not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())
