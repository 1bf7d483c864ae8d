"""A router over scripted workers (tests/router/test_typed_flow.py) served by the real
HTTP front end (``HttpServer``: uvicorn on a free loopback port) in a background event
loop, so that synchronous clients (the ``openai`` client, httpx) can drive it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from router.http.server import HttpServer
from router.router import Router
from tests.router.test_typed_flow import ScriptedWorker
from workers.protocol.wire import WorkItem


class EndlessWorker(ScriptedWorker):
    """Decodes (one token per 5 ms) until the request is aborted, whatever max_tokens says:
    a request that only ends when its client goes away."""

    async def _generate(self, item: WorkItem) -> None:
        if item.mode == "prefill":
            await super()._generate(item)
            return
        i = 0
        while item.request_id not in self.aborted:
            await asyncio.sleep(0.005)
            token_id = self.output_ids[i % len(self.output_ids)]
            self._send([self._event(item, (token_id,), finished=False)])
            i += 1
        self._send([self._event(item, (), finished=True, finish_reason="abort")])


@dataclass
class Served:
    router: Router
    prefill: ScriptedWorker
    decode: ScriptedWorker
    output_ids: list[int]
    url: str  # http://127.0.0.1:PORT
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` (a coroutine function) on the router's loop; its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(30)  # type: ignore[arg-type]

    def wait_settled(self, timeout_s: float = 10.0) -> None:
        wait_settled(self.router, timeout_s)


def wait_settled(router, timeout_s: float = 10.0) -> None:
    """Until ``router`` has no request in flight (each ended on its worker)."""
    deadline = time.monotonic() + timeout_s
    while router.num_in_flight:
        if time.monotonic() > deadline:
            raise AssertionError(f"{router.num_in_flight} requests still in flight")
        time.sleep(0.01)


@contextlib.contextmanager
def serve(router_parts, **http) -> Iterator[Served]:
    """``router_parts``: make_router's (router, prefill, decode, output_ids)."""
    router, prefill, decode, output_ids = router_parts
    loop = asyncio.new_event_loop()
    started: list[HttpServer] = []
    ready = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        await router.start(ready_timeout_s=5)
        server = HttpServer(router, "127.0.0.1", 0, **http)
        await server.start()
        started.append(server)
        ready.set()
        try:
            await stop.wait()
        finally:
            await server.stop()
            await router.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the HTTP server did not start")
    try:
        yield Served(router, prefill, decode, output_ids, f"http://{started[0].address}", loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def endless_router(tokenizer, **config):
    """make_router's parts with an EndlessWorker as the decode worker."""
    from tests.router.test_typed_flow import make_router

    router, prefill, _, output_ids = make_router(tokenizer, **config)
    endless = EndlessWorker("decode-0", "decode", output_ids)
    return Router(router.config, tokenizer, [prefill], [endless]), prefill, endless, output_ids
