"""One request's inbox at the router: worker events in arrival order, read by its stream.

The router's batch intake (``Router._on_batch``) puts each worker event of the request
here, with the worker's name; an abort or a worker's death puts ``(source, None)``. The
request's stream (``Pending.stream_from``, ``Pending.settle``) is the only reader.

Not an ``asyncio.Queue``: a request has one reader and no bound, so a deque and one
waiter future do, at about half the cost per event (the queue's per-event bookkeeping
was 4% of the router's CPU per streamed token, bench/RESULTS.md). The reader can also
see what is queued (``peek``) and take it at once: events that piled up while the
client's stream was busy go out as one chunk (``Pending.stream_from``). A deadline is a
timer on the waiter, not ``asyncio.wait_for``'s task per event.
"""

from __future__ import annotations

import asyncio
from collections import deque

from workers.protocol.wire import TokenEvent

Item = tuple[str, TokenEvent | None]  # (the worker's name or "", its event or a wake-up)


class EventQueue:
    """FIFO of one request's worker events; one reader at a time."""

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Item) -> None:
        """Router side: queue ``item`` and wake the reader."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def put(self, item: Item) -> None:
        self.put_nowait(item)

    def peek(self) -> Item | None:
        """The next item without taking it; None when empty."""
        return self._items[0] if self._items else None

    def get_nowait(self) -> Item:
        """The next item; IndexError when empty."""
        return self._items.popleft()

    async def get(self, timeout: float | None = None) -> Item:
        """The next item, waiting for one; ``asyncio.TimeoutError`` after ``timeout`` s."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        timer = None
        if timeout is not None:
            timer = loop.call_later(max(0.0, timeout), _expire, self)
        try:
            while not self._items:
                self._waiter = loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        except asyncio.TimeoutError:
            if not self._items:
                raise
        finally:
            if timer is not None:
                timer.cancel()
        return self._items.popleft()


def _expire(queue: EventQueue) -> None:
    waiter = queue._waiter
    if waiter is not None and not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())
