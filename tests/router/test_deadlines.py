"""Server-side deadlines (router.request_timeout_seconds, router.request_idle_timeout_seconds):
a request past either ends with DEADLINE_EXCEEDED, on its workers too (aborted there,
its held KV declined), and the router keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from cluster.tools.make_model import build_tokenizer
from router.errors import ErrorCode, RouterError
from router.requests import GenerateRequest, StoppingOptions
from tests.router.http_harness import EndlessWorker
from tests.router.test_typed_flow import ScriptedWorker, make_router, run
from workers.protocol.wire import WorkItem
from workers.text.tokenizer import Tokenizer


class SilentWorker(ScriptedWorker):
    """Takes decode work and produces nothing for it (stuck on the request) until it is
    aborted, which it then confirms."""

    async def _generate(self, item: WorkItem) -> None:
        if item.mode == "prefill":
            await super()._generate(item)
        else:
            self.items_held = getattr(self, "items_held", {}) | {item.request_id: item}

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        item = getattr(self, "items_held", {}).get(request_id)
        if item is not None:
            self._send([self._event(item, (), finished=True, finish_reason="abort")])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


def request(request_id: str, max_tokens: int = 200) -> GenerateRequest:
    return GenerateRequest("hello", request_id, stopping=StoppingOptions(max_tokens=max_tokens))


async def outcome(router, req):
    tokens = 0
    try:
        async for event in router.generate(req):
            tokens += len(event.delta.token_ids)
    except RouterError as exc:
        return exc.code, exc.message, tokens
    return None, "", tokens


def test_a_silent_worker_meets_the_idle_deadline(tokenizer):
    router, _, _, output_ids = make_router(tokenizer, request_idle_timeout_s=0.3)
    silent = SilentWorker("decode-0", "decode", output_ids)
    router.decode[0].client = silent

    async def body(router):
        code, message, tokens = await outcome(router, request("lost"))
        for _ in range(100):  # settle: the abort goes out after the stream ended
            if "lost" in silent.aborted:
                break
            await asyncio.sleep(0.01)
        return code, message, tokens, router.num_in_flight

    code, message, tokens, in_flight = run(router, body)
    assert code is ErrorCode.DEADLINE_EXCEEDED
    assert "without output (router.request_idle_timeout_seconds)" in message
    assert tokens == 1  # the prefill worker's first token came
    assert "lost" in silent.aborted and in_flight == 0


def test_a_request_past_its_total_deadline_is_ended_everywhere(tokenizer):
    router, _, _, output_ids = make_router(tokenizer, request_timeout_s=0.4)
    endless = EndlessWorker("decode-0", "decode", output_ids)
    router.decode[0].client = endless

    async def body(router):
        first = await outcome(router, request("long"))
        for _ in range(100):
            if "long" in endless.aborted:
                break
            await asyncio.sleep(0.01)
        # Still serving: the next one is admitted, streams, and meets the same end.
        second = await outcome(router, request("next"))
        for _ in range(100):
            if not router.num_in_flight:
                break
            await asyncio.sleep(0.01)
        return first, second, router.num_in_flight

    (code, message, tokens), second, in_flight = run(router, body)
    assert code is ErrorCode.DEADLINE_EXCEEDED and "router.request_timeout_seconds" in message
    assert tokens > 10  # it streamed until the deadline
    assert "long" in endless.aborted and "next" in endless.aborted
    assert second[0] is ErrorCode.DEADLINE_EXCEEDED and second[2] > 10
    assert in_flight == 0
