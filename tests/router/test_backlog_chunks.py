"""Events that queued up for one request while its client's stream was busy go out as one
chunk (``RequestLife.run``); idle, each engine step is a chunk of its own.

A "burst" worker sends every step of a request as its own batch without letting the
event loop run in between, as a router under load finds them: all of them are queued
before the stream reads the first. The merged chunk must carry exactly what the
per-step events would have: the tokens, their text, their logprobs, the stop string cut
at the token that completed it (the worker then aborted), the finish and its usage.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.tools.make_model import build_tokenizer
from router.events import Delta, Finish, GenerateEvent, Usage
from router.inbox import ABORT, Inbox, WorkerEvent, WorkerGone
from router.requests import GenerateRequest, OutputOptions, StoppingOptions
from router.stream import merge_events
from tests.router.test_typed_flow import (
    PROMPT,
    ScriptedWorker,
    collect,
    make_router,
    run,
)
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.wire import TokenEvent, WorkItem
from workers.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


class BurstWorker(ScriptedWorker):
    """Sends all of a request's steps back to back, one batch per step."""

    async def _generate(self, item: WorkItem) -> None:
        max_tokens = item.params.max_tokens or len(self.output_ids)
        for i in range(max_tokens):
            is_last = i == max_tokens - 1
            token_id = self.output_ids[i % len(self.output_ids)]
            reason = "length" if is_last else None
            self._send([self._event(item, (token_id,), finished=is_last, finish_reason=reason)])


def burst_router(tokenizer, with_logprobs=False):
    router, _, paced, output_ids = make_router(tokenizer, disaggregation="never")
    burst = BurstWorker("decode-0", "decode", output_ids, with_logprobs=with_logprobs)
    router.decode[0].client = burst
    return router, burst, paced, output_ids


def test_a_backlog_goes_out_as_one_chunk_and_idle_steps_one_each(tokenizer):
    router, _, _, output_ids = burst_router(tokenizer)
    req = GenerateRequest(PROMPT, "r", stopping=StoppingOptions(max_tokens=12))
    events = run(router, lambda r: collect(r, req))
    assert len(events) == 1
    (event,) = events
    assert event.delta.token_ids == tuple(output_ids[:12])
    assert event.delta.text == tokenizer.decode(output_ids[:12])
    assert event.finish is not None and event.finish.reason == "length"
    assert event.finish.usage.completion_tokens == 12

    # The paced worker (a step per millisecond, the stream keeps up): a chunk per step.
    router, _, _, _ = make_router(tokenizer, disaggregation="never")
    paced = run(router, lambda r: collect(r, req))
    assert [len(e.delta.token_ids) for e in paced] == [1] * 12
    assert "".join(e.delta.text for e in paced) == event.delta.text


def test_a_stop_string_inside_a_backlog_ends_the_chunk_at_its_token(tokenizer):
    router, burst, _, output_ids = burst_router(tokenizer)
    stop = " curious"
    req = GenerateRequest(PROMPT, "s", stopping=StoppingOptions(max_tokens=20, stop=(stop,)))

    async def body(router):
        events = await collect(router, req)
        for _ in range(100):  # settle: the abort goes out after the stream ended
            if not router.num_in_flight:
                break
            await asyncio.sleep(0.01)
        return events

    (event,) = run(router, body)
    text = tokenizer.decode(output_ids[:20])
    assert event.delta.text == text[: text.index(stop)]
    # The tokens up to the one that completed the stop string, no further.
    num = next(n for n in range(1, 21) if stop in tokenizer.decode(output_ids[:n]))
    assert event.delta.token_ids == tuple(output_ids[:num]) and num < 20
    assert event.finish is not None and event.finish.reason == "stop"
    assert event.finish.stop_string == stop and event.finish.usage.completion_tokens == num
    assert "s" in burst.aborted  # the worker had not ended it: the router aborted it there


def test_a_backlog_keeps_each_tokens_logprobs(tokenizer):
    router, _, _, output_ids = burst_router(tokenizer, with_logprobs=True)
    req = GenerateRequest(
        PROMPT, "l", stopping=StoppingOptions(max_tokens=5), output=OutputOptions(logprobs=1)
    )
    (event,) = run(router, lambda r: collect(r, req))
    assert [lp.token_id for lp in event.delta.logprobs] == output_ids[:5]


def test_a_disaggregated_backlog_follows_the_first_token(tokenizer):
    router, prefill, _, output_ids = make_router(tokenizer)  # prefill on P, decode on D
    router.decode[0].client = BurstDecode("decode-0", "decode", output_ids)
    req = GenerateRequest(PROMPT, "d", stopping=StoppingOptions(max_tokens=8))
    events = run(router, lambda r: collect(r, req))
    assert [len(e.delta.token_ids) for e in events] == [1, 7]
    assert sum((e.delta.token_ids for e in events), ()) == tuple(output_ids[:8])
    assert "".join(e.delta.text for e in events) == tokenizer.decode(output_ids[:8])
    assert prefill.items[0].mode == "prefill"


class BurstDecode(ScriptedWorker):
    """A decode worker that sends the steps after the first token back to back."""

    async def _generate(self, item: WorkItem) -> None:
        max_tokens = item.params.max_tokens or len(self.output_ids)
        for i in range(1, max_tokens):
            is_last = i == max_tokens - 1
            reason = "length" if is_last else None
            token = (self.output_ids[i],)
            self._send([self._event(item, token, finished=is_last, finish_reason=reason)])


def test_merge_events_keeps_order_prompt_logprobs_and_the_last_finish():
    lp = [TokenLogprobs(t, -1.0, 1, (t,), (-1.0,)) for t in (7, 8, 9)]
    prompt = (TokenLogprobs(5, -2.0, 1, (), ()),)
    finish = Finish("length", Usage(2, 3, 0))
    merged = merge_events(
        [
            GenerateEvent("r", Delta((7,), "a", (lp[0],), prompt, (4, 5))),
            GenerateEvent("r", Delta((8,), "b", (lp[1],))),
            GenerateEvent("r", Delta((9,), "c", (lp[2],)), finish),
        ]
    )
    assert merged == GenerateEvent("r", Delta((7, 8, 9), "abc", tuple(lp), prompt, (4, 5)), finish)
    one = GenerateEvent("r", Delta((1,), "x"))
    assert merge_events([one]) is one


def test_the_inbox_is_fifo_and_times_out_without_a_task():
    event = WorkerEvent("w", TokenEvent("r", (1,), False))

    async def body():
        inbox = Inbox()
        with pytest.raises(asyncio.TimeoutError):
            await inbox.get(0.01)
        inbox.put(event)
        inbox.put(ABORT)
        assert len(inbox) == 2 and inbox.queued[0] == event
        assert await inbox.get(0.01) == event
        assert inbox.queued.popleft() is ABORT and not inbox.queued
        # A reader waiting is woken by the next put, before its timeout.
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, inbox.put, event)
        assert await inbox.get(5.0) == event
        # Cancelled while waiting: nothing is lost, the next reader gets the next item.
        waiting = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        inbox.put(WorkerGone("w"))
        assert await inbox.get(0.1) == WorkerGone("w")
        inbox.put_event("w", event.event)
        assert inbox.queued[0] == event and type(inbox.queued[0]) is WorkerEvent
        inbox.clear()
        assert not inbox.queued and not inbox

    asyncio.run(body())
