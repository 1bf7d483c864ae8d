"""The choices of one HTTP request read as one stream, and what ends them early.

:class:`Choices` runs one ``Router.generate`` per choice and merges their events. Its
:meth:`Choices.start` waits for every choice's first event, so that a refusal (bad field,
queue full, draining) is known before the HTTP status is sent: the router refuses on the
first step of a stream, before any output. Closing it closes every router stream, which
aborts those requests on their workers (``Router.generate``'s contract), so whoever ends
the HTTP exchange early, a disconnected client included, leaves no KV block in use.

A client that goes away is noticed from the ASGI ``http.disconnect`` message, not only
from a failed write: a request still waiting for its first token (queued, prefilling)
is aborted at once, not at its next token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.errors import ErrorCode, RouterError
from router.events import GenerateEvent
from router.metrics import RouterMetrics
from router.requests import GenerateRequest
from router.router import Router

logger = logging.getLogger(__name__)

T = TypeVar("T")
_END = object()


class Choices:
    """``len(requests)`` router streams merged; events come as ``(choice index, event)``."""

    def __init__(
        self, router: Router, requests: tuple[GenerateRequest, ...], metrics: RouterMetrics
    ):
        self._streams = [router.generate(req) for req in requests]
        self._metrics = metrics
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffered: list[tuple[int, GenerateEvent]] = []
        self._num_open = len(requests)

    async def start(self) -> None:
        """Wait for every choice's first event; raises the first RouterError (and closes)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        waiting = set(range(len(self._streams)))
        try:
            while waiting:
                item = await self._next()
                if item is None:  # a stream ended without events: only when aborted
                    break
                self._buffered.append(item)
                waiting.discard(item[0])
        except BaseException:
            await self.aclose()
            raise

    async def events(self) -> AsyncIterator[tuple[int, GenerateEvent]]:
        """Every event, the buffered first ones first; raises a RouterError of a choice."""
        buffered, self._buffered = self._buffered, []
        for item in buffered:
            yield item
        while (item := await self._next()) is not None:
            yield item

    async def _next(self) -> tuple[int, GenerateEvent] | None:
        """The next event of any choice; None when every stream ended."""
        while self._num_open:
            index, value = await self._queue.get()
            if value is _END:
                self._num_open -= 1
            elif isinstance(value, BaseException):
                raise value
            else:
                return index, value
        return None

    async def _pump(self, index: int, stream: AsyncIterator[GenerateEvent]) -> None:
        call = self._metrics.call()
        try:
            async for event in stream:
                call.event(event)
                self._queue.put_nowait((index, event))
        except RouterError as exc:
            call.error(exc.code)
            self._queue.put_nowait((index, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: INTERNAL to this client, keep serving
            logger.exception("request failed")
            call.error(ErrorCode.INTERNAL)
            error = RouterError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            self._queue.put_nowait((index, error))
        finally:
            call.closed()  # no Final and no error: the client went away
            self._queue.put_nowait((index, _END))
            await stream.aclose()  # aborts the request on its worker if it had not ended

    async def aclose(self) -> None:
        """End every choice; those not finished are aborted on their workers."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:  # the ones whose pump never started
            await stream.aclose()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGone (``work`` cancelled) if the client goes first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is closed however the exchange ends.

    Starlette's StreamingResponse notices a gone client only when a write fails (ASGI 2.4
    servers), and leaves its iterator unclosed; here the iterator runs beside a listener
    for ``http.disconnect`` and is always closed (which closes its Choices).
    """

    def __init__(self, content: Callable[[], AsyncIterator[bytes]] | AsyncIterator[bytes]):
        super().__init__(
            content,  # type: ignore[arg-type]
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, gone):
                task.cancel()
            results = await asyncio.gather(body, gone, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            logger.error("event stream failed", exc_info=error)
