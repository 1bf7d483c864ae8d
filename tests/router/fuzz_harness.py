"""What both front-end fuzzers share: a real router behind a real front end (gRPC's
``Server`` or the HTTP app under uvicorn) over scripted workers whose submit sends each
work item through the real worker wire codec (msgpack), so a value the router lets through
but the wire to a real worker cannot carry fails here as it would in a cluster.

``HYPOTHESIS_PROFILE=campaign`` with ``FUZZ_EXAMPLES=N`` (tests/conftest.py) runs each fuzzer
with N examples; a :class:`Counter` tallies the inputs each one tried into
``$FUZZ_COUNT_FILE`` (one ``name count`` line per fuzzer), which ``python -m bench.fuzz``
reads back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import settings

from router.config import RouterConfig
from router.router import Router
from router.server import Server
from router.tracing import Tracing
from tests.router.test_typed_flow import OUTPUT, ScriptedWorker
from workers.protocol.wire import WorkItem, decode_as, encode
from workers.text.tokenizer import Tokenizer

# A refusal's message starts with the field it names: ``sampling.top_p: ...``, ``prompt: ...``.
FIELD_FIRST = re.compile(r"^[A-Za-z_][\w.\[\]]*: ")
MAX_QUEUED = 64  # a batch of prompts x n past it meets RESOURCE_EXHAUSTED / 429


class WireWorker(ScriptedWorker):
    """A scripted worker that receives its work through the real wire codec."""

    async def submit(self, item: WorkItem) -> None:
        await super().submit(decode_as(encode(item), WorkItem))

    async def _generate(self, item: WorkItem) -> None:
        if item.mode == "prefill" and item.params.max_tokens == 1:
            # As the real engine: the first token is the last, no KV is held for a decode
            # worker (tests/workers/test_engine_roles.py); the scripted one would hand off.
            first = self.output_ids[:1]
            self._send([self._event(item, first, finished=True, finish_reason="length")])
            return
        await super()._generate(item)


def fuzz_router(tokenizer: Tokenizer, tracing: Tracing | None = None) -> Router:
    """A router (kv_aware, auto disaggregation) over one wire-checked worker per role;
    ``tracing``: trace every request (the callers' ``traceparent`` / ``tracestate`` read)."""
    output_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    cfg = RouterConfig(
        model_name="tiny",
        architecture="LlamaForCausalLM",
        dtype="float32",
        max_model_len=256,
        vocab_size=tokenizer.vocab_size,
        block_size=8,
        disaggregation="always",
        max_queued_requests=MAX_QUEUED,
    )
    prefill = WireWorker("prefill-0", "prefill", output_ids)
    decode = WireWorker("decode-0", "decode", output_ids)
    return Router(cfg, tokenizer, [prefill], [decode], tracing=tracing)


@dataclass
class GrpcServed:
    router: Router
    target: str  # 127.0.0.1:PORT
    loop: asyncio.AbstractEventLoop  # the server's


@contextlib.contextmanager
def serve_grpc(router: Router, **server) -> Iterator[GrpcServed]:
    """The real gRPC server on a free loopback port, in a background event loop;
    ``server``: ``Server``'s keyword arguments (``keys``, ``tls``)."""
    server_options = server
    loop = asyncio.new_event_loop()
    started: list[Server] = []
    ready = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        await router.start(ready_timeout_s=5)
        server = Server(router, "127.0.0.1", 0, **server_options)
        await server.start()
        started.append(server)
        ready.set()
        try:
            await stop.wait()
        finally:
            await server.stop(0.5)
            await router.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the gRPC server did not start")
    try:
        yield GrpcServed(router, started[0].address, loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def examples(default: int) -> int:
    """This fuzzer's example count: ``default`` (a test run well under a minute), or under
    ``HYPOTHESIS_PROFILE=campaign`` the profile's (``FUZZ_EXAMPLES``, default 2000)."""
    if os.environ.get("HYPOTHESIS_PROFILE") == "campaign":
        return settings().max_examples
    return default


class Counter:
    """Inputs one fuzzer tried; written to ``$FUZZ_COUNT_FILE`` (``name count``) at the end."""

    def __init__(self, name: str):
        self.name = name
        self.count = 0

    def __call__(self) -> None:
        self.count += 1

    def flush(self) -> None:
        path = os.environ.get("FUZZ_COUNT_FILE")
        if path:
            with open(path, "a") as f:
                f.write(f"{self.name} {self.count}\n")
