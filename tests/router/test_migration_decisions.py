"""The router's migration decisions (router/migration.py) with scripted fake workers.

What must hold: when a request's decode worker is lost, the router resubmits it to
another decode worker as ``full`` work carrying exactly the tokens the client already
has, and the client's stream continues with no token repeated or lost; the lost
worker's stale events are ignored; the routed-load count moves from the lost worker to
the new one; a prefill worker's handle that no decode worker took is declined; a
retryable failure of a live worker (a KV transfer) migrates as ``transfer_failed``.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from prometheus_client import REGISTRY

from router.config import RouterConfig
from router.errors import ErrorCode, RouterError
from router.migration import reroute
from router.policy import RouteDecision
from router.router import Router
from tests.router.http_harness import serve
from tests.router.test_typed_flow import PROMPT, ScriptedWorker, collect, request, run, settled
from tests.router.test_typed_flow import tokenizer as tokenizer
from workers.protocol.wire import WorkItem

OUTPUT_IDS = list(range(40, 60))


def migrations(cause: str) -> float:
    labels = {"role": "router", "model": "tiny", "instance": "router", "cause": cause}
    return REGISTRY.get_sample_value("baton_router_migrations_total", labels) or 0.0


class Worker(ScriptedWorker):
    """Resumes ``full`` work after its ``output_token_ids``; ``die_after`` tokens of a
    request it dies (a failed event and the death report, or its channel closing)."""

    def __init__(self, name, role, die_after=None, how="channel", retryable_error=""):
        super().__init__(name, role, OUTPUT_IDS)
        self.die_after, self.how, self.retryable_error = die_after, how, retryable_error
        self.on_lost = None
        self.routed_seen: list[set[str]] = []  # what the router counted here, at each submit

    def listen(self, on_batch, on_lost) -> None:
        self.on_lost = on_lost
        super().listen(on_batch, on_lost)

    async def _generate(self, item: WorkItem) -> None:
        if item.mode != "full" or self.die_after is None:
            if item.mode == "full" and item.output_token_ids:
                return await self._resume(item)
            return await super()._generate(item)
        for i in range(self.die_after):
            await asyncio.sleep(0.001)
            self._send([self._event(item, (OUTPUT_IDS[i],), finished=False)])
        if self.retryable_error:  # the worker lives on
            error = self.retryable_error
            self._send([self._event(item, (), finished=True, error=error, is_retryable=True)])
        elif self.how == "channel":
            self.on_lost("connection closed")
            self._send([self._event(item, (OUTPUT_IDS[self.die_after],), finished=False)])
        else:
            failed = self._event(item, (), finished=True, error="device lost", is_retryable=True)
            self._send([failed])
            self.on_lost("engine loop died")

    async def _resume(self, item: WorkItem) -> None:
        max_tokens = item.params.max_tokens
        for i in range(len(item.output_token_ids), max_tokens):
            await asyncio.sleep(0.001)
            last = i == max_tokens - 1
            reason = "length" if last else None
            token = (OUTPUT_IDS[i % len(OUTPUT_IDS)],)
            self._send([self._event(item, token, finished=last, finish_reason=reason)])


def make_router(tokenizer, workers, disaggregation="never", **config):
    cfg = RouterConfig(
        "tiny", "LlamaForCausalLM", "float32", 256, tokenizer.vocab_size, 8,
        disaggregation=disaggregation, policy="round_robin", **config,
    )  # fmt: skip
    prefill = [w for w in workers if w.role == "prefill"]
    decode = [w for w in workers if w.role == "decode"]
    return Router(cfg, tokenizer, prefill, decode)


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.delta.token_ids]


def test_a_lost_decode_worker_s_request_resumes_elsewhere_with_the_streamed_tokens(tokenizer):
    for how, cause in (("channel", "decode_worker_died"), ("engine", "decode_worker_died")):
        dead = Worker("decode-0", "decode", die_after=5, how=how)
        other = Worker("decode-1", "decode")
        router = make_router(tokenizer, [dead, other])
        before = migrations(cause)

        async def body(r):
            events = await collect(r, request(max_tokens=12, request_id="m"))
            routed_on_dead = dict(r.decode[0].routed)
            await settled(r)
            return events, routed_on_dead

        events, routed_on_dead = run(router, body)
        assert tokens_of(events) == OUTPUT_IDS[:12], how  # none repeated, none lost
        assert events[-1].finish.reason == "length"
        assert events[-1].finish.usage.completion_tokens == 12
        (item,) = other.items
        assert item.mode == "full" and item.output_token_ids == tuple(OUTPUT_IDS[:5])
        assert routed_on_dead == {}  # the lost worker no longer counts it
        assert not router.decode[1].routed  # and the new one stopped once it ended
        assert migrations(cause) == before + 1


def test_the_routed_count_moves_to_the_new_worker(tokenizer):
    dead = Worker("decode-0", "decode", die_after=3, how="engine")
    other = Worker("decode-1", "decode")
    router = make_router(tokenizer, [dead, other])

    async def body(r):
        task = asyncio.ensure_future(collect(r, request(max_tokens=200, request_id="m")))
        while not other.items:
            assert not task.done(), task
            await asyncio.sleep(0.001)
        counted = set(r.decode[1].routed), set(r.decode[0].routed)
        await r.abort("m")
        await task
        return counted

    on_new, on_dead = run(router, body)
    assert on_new == {"m"} and on_dead == set()


def test_a_handle_nobody_took_is_declined_and_the_first_token_not_repeated(tokenizer):
    prefill = Worker("prefill-0", "prefill")
    dead = Worker("decode-0", "decode")
    other = Worker("decode-1", "decode")
    router = make_router(tokenizer, [prefill, dead, other], disaggregation="always")

    # Route first, then lose decode-0 before the hand-off: hold prefill's answer back.
    real_generate = prefill._generate

    async def slow_prefill(item):
        await asyncio.sleep(0.05)
        await real_generate(item)

    prefill._generate = slow_prefill

    async def body_late(r):
        task = asyncio.ensure_future(collect(r, request(max_tokens=8, request_id="h")))
        while not prefill.items:
            assert not task.done(), task
            await asyncio.sleep(0.001)
        dead.on_lost("connection closed")
        return await task

    events = run(router, body_late)
    assert tokens_of(events) == OUTPUT_IDS[:8]
    assert dead.items == [] and other.declined == [(b"kv-h",)]
    (item,) = other.items
    assert item.mode == "full" and item.output_token_ids == (OUTPUT_IDS[0],)


def test_a_retryable_failure_of_a_live_worker_migrates_as_transfer_failed(tokenizer):
    flaky = Worker("decode-0", "decode", die_after=2, retryable_error="KV transfer failed: x")
    other = Worker("decode-1", "decode")
    router = make_router(tokenizer, [flaky, other])
    before = migrations("transfer_failed")

    async def body(r):
        return await collect(r, request(max_tokens=6, request_id="t")), r.decode[0].is_alive

    events, is_alive = run(router, body)
    assert tokens_of(events) == OUTPUT_IDS[:6]
    assert is_alive  # not a death: the worker stays in routing
    assert migrations("transfer_failed") == before + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_http_front_end_gets_the_whole_output_too(tokenizer, stream):
    dead = Worker("decode-0", "decode", die_after=4, how="engine")
    other = Worker("decode-1", "decode")
    router = make_router(tokenizer, [dead, other])
    before = migrations("decode_worker_died")
    with serve((router, None, dead, OUTPUT_IDS)) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.0, stream=stream
        )
        chunks = list(out) if stream else [out]
        served.wait_settled()
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(OUTPUT_IDS[:10])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert other.items[0].output_token_ids == tuple(OUTPUT_IDS[:4])
    assert migrations("decode_worker_died") == before + 1


def test_reroute_picks_the_decode_pool_once_output_was_streamed_else_routes_as_new():
    calls: list[tuple[int, str | None]] = []

    def route(token_ids: list[int], disaggregation: str | None) -> RouteDecision:
        calls.append((len(token_ids), disaggregation))
        if disaggregation is None and no_prefill_left:
            raise RouterError(ErrorCode.UNAVAILABLE, "no healthy prefill worker")
        return RouteDecision(f"d{len(calls)}", None, cached_tokens=0, round_robin_cursor=0)

    no_prefill_left = False
    assert reroute(route, [1, 2, 3], [7, 8]).decode == "d1"  # prompt + output, on D
    assert reroute(route, [1, 2, 3], []).decode == "d2"  # as new, by the policy
    no_prefill_left = True
    assert reroute(route, [1, 2, 3], []).decode == "d4"  # no P left: prefill on D
    assert calls == [(5, "never"), (3, None), (3, None), (3, "never")]
