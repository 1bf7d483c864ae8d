"""A request's life in the router (router/lifecycle.py): its states, and one settle per request.

Every path a request can end by is driven through a real :class:`~router.router.Router`
with scripted workers (the fakes of test_typed_flow.py): its finish, a stop string on the
handed-off first token, an abort, a client gone (during the hand-off and while
decoding), a deadline, a lost worker with and without migration, the drain, and the
layer-wise order. Each must walk exactly the states the module's table says, settle
exactly once (the router's ``on_settled``), and leave nothing behind: no worker counts
the request, no quota share is held, the id is free, a handle no decode worker took was
declined, the worker still running it was told. Illegal transitions are refused.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import pytest
from msgspec.structs import replace

from router.errors import ErrorCode, RouterError
from router.lifecycle import TRANSITIONS, IllegalTransition, RequestLife, State
from router.requests import StoppingOptions
from router.router import Router
from router.stream import RequestStream
from router.tracing import NO_TRACE
from tests.router.test_migration_decisions import Worker
from tests.router.test_migration_decisions import make_router as make_pools
from tests.router.test_typed_flow import (
    ScriptedWorker,
    collect,
    make_router,
    request,
    run,
    settled,
)
from tests.router.test_typed_flow import tokenizer as tokenizer
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.wire import OutputBatch, WorkerReport, WorkItem

WHOLE = ["routed", "prefilling", "handing_off", "decoding", "settling", "settled"]
FULL = ["routed", "decoding", "settling", "settled"]


@pytest.fixture
def lives(monkeypatch):
    """Each request's states in order, and how often the router's release ran for it."""
    states: dict[str, list[str]] = defaultdict(list)
    num_settled: Counter[str] = Counter()
    to, release = RequestLife._to, Router._settled

    def recording_to(life, state):
        to(life, state)
        states[life.stream.request_id].append(state.value)

    def counting_release(router, life):
        num_settled[life.stream.request_id] += 1
        release(router, life)

    monkeypatch.setattr(RequestLife, "_to", recording_to)
    monkeypatch.setattr(Router, "_settled", counting_release)
    return states, num_settled


def assert_nothing_held(router: Router) -> None:
    for view in [*router.prefill, *router.decode]:
        assert view.routed == {} and view.active == set(), view.name
    assert router.quotas.total == 0 and router.num_in_flight == 0


async def ended(router: Router, body):
    """``body``'s result once every request settled."""
    result = await body
    await settled(router)
    return result


def test_a_finished_request_walks_the_hand_off_and_settles_once(tokenizer, lives):
    states, num_settled = lives
    router, prefill, decode, _ = make_router(tokenizer)
    events = run(router, lambda r: ended(r, collect(r, request(request_id="a"))))
    assert events[-1].finish.reason == "length"
    assert states["a"] == WHOLE and num_settled == {"a": 1}
    assert not prefill.aborted and not decode.aborted  # both ended there on their own
    assert_nothing_held(router)

    router, _, decode, _ = make_router(tokenizer, "never")
    run(router, lambda r: ended(r, collect(r, request(request_id="f"))))
    assert states["f"] == FULL and num_settled["f"] == 1
    assert decode.items[0].mode == "full"
    assert_nothing_held(router)


def test_a_stop_string_on_the_first_token_declines_the_handle(tokenizer, lives):
    states, num_settled = lives
    router, _, decode, output_ids = make_router(tokenizer)
    stop = tokenizer.decode(output_ids[:1]).strip()  # completed by P's first token
    req = request(request_id="s", stopping=StoppingOptions(max_tokens=20, stop=(stop,)))
    events = run(router, lambda r: ended(r, collect(r, req)))
    assert events[-1].finish.reason == "stop" and events[-1].finish.stop_string == stop
    assert states["s"] == ["routed", "prefilling", "handing_off", "settling", "settled"]
    assert num_settled == {"s": 1}
    assert decode.items == [] and decode.declined == [(b"kv-s",)]  # P's lease ends
    assert_nothing_held(router)


def test_an_abort_while_decoding_ends_it_on_its_worker(tokenizer, lives):
    states, num_settled = lives
    router, _, decode, _ = make_router(tokenizer)

    async def body(r):
        stream = r.generate(request(max_tokens=200, request_id="x"))
        events = [await anext(stream), await anext(stream)]
        assert await r.abort("x") and not await r.abort("nobody")
        events += [e async for e in stream]
        return events

    events = run(router, lambda r: ended(r, body(r)))
    assert events[-1].finish.reason == "abort"
    assert states["x"] == WHOLE and num_settled == {"x": 1}
    assert decode.aborted == ["x"]
    assert_nothing_held(router)


def test_a_client_gone_during_the_hand_off_or_while_decoding(tokenizer, lives):
    states, num_settled = lives
    router, prefill, decode, _ = make_router(tokenizer)

    async def gone_after_first(r, request_id):
        stream = r.generate(request(max_tokens=200, request_id=request_id))
        first = await anext(stream)
        await stream.aclose()  # the client left
        return first

    # After P's first token, before D had the handle: the handle is declined, D never
    # hears of the request, P has already ended it.
    run(router, lambda r: ended(r, gone_after_first(r, "h")))
    assert states["h"] == ["routed", "prefilling", "handing_off", "settling", "settled"]
    assert decode.items == [] and decode.declined == [(b"kv-h",)] and not prefill.aborted
    assert_nothing_held(router)

    router, _, decode, _ = make_router(tokenizer, "never")
    run(router, lambda r: ended(r, gone_after_first(r, "d")))
    assert states["d"] == FULL and decode.aborted == ["d"]
    assert num_settled == {"h": 1, "d": 1}
    assert_nothing_held(router)


class Stalling(ScriptedWorker):
    """Takes work and sends nothing until it is aborted (then its final event)."""

    async def _generate(self, item: WorkItem) -> None:
        self.item = item

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self._send([self._event(self.item, (), finished=True, finish_reason="abort")])


def test_a_deadline_ends_it_on_its_worker(tokenizer, lives):
    states, num_settled = lives
    router, _, _, output_ids = make_router(tokenizer, "never", request_idle_timeout_s=0.05)
    stalling = Stalling("decode-0", "decode", output_ids)
    router.decode[0].client = stalling

    async def body(r):
        with pytest.raises(RouterError) as failed:
            await collect(r, request(request_id="t"))
        return failed.value

    error = run(router, lambda r: ended(r, body(r)))
    assert error.code == ErrorCode.DEADLINE_EXCEEDED
    assert states["t"] == FULL and num_settled == {"t": 1}
    assert stalling.aborted == ["t"]
    assert_nothing_held(router)


def test_a_lost_worker_migrates_or_fails_and_settles_once(tokenizer, lives):
    states, num_settled = lives
    dead, other = Worker("decode-0", "decode", die_after=3), Worker("decode-1", "decode")
    router = make_pools(tokenizer, [dead, other])
    events = run(router, lambda r: ended(r, collect(r, request(max_tokens=8, request_id="m"))))
    assert events[-1].finish.usage.completion_tokens == 8
    migrated = ["routed", "decoding", "migrating", "routed", "decoding", "settling", "settled"]
    assert states["m"] == migrated and num_settled["m"] == 1
    assert_nothing_held(router)

    dead = Worker("decode-0", "decode", die_after=3, how="engine")
    router = make_pools(tokenizer, [dead, Worker("decode-1", "decode")], migration_limit=0)

    async def body(r):
        with pytest.raises(RouterError) as failed:
            await collect(r, request(max_tokens=8, request_id="u"))
        return failed.value

    error = run(router, lambda r: ended(r, body(r)))
    assert error.code == ErrorCode.UNAVAILABLE and "migration_limit=0" in error.message
    assert states["u"] == ["routed", "decoding", "migrating", "settling", "settled"]
    assert num_settled["u"] == 1
    assert_nothing_held(router)


def test_the_drain_aborts_what_runs_past_its_grace(tokenizer, lives):
    states, num_settled = lives
    router, _, decode, _ = make_router(tokenizer, "never")

    async def body(r):
        stream = r.generate(request(max_tokens=200, request_id="g"))
        first = await anext(stream)
        drained = asyncio.ensure_future(r.drain(0.0))
        events = [first, *[e async for e in stream]]
        return events, await drained

    events, num_aborted = run(router, lambda r: ended(r, body(r)))
    assert num_aborted == 1 and events[-1].finish.reason == "abort"
    assert states["g"] == FULL and num_settled == {"g": 1} and decode.aborted == ["g"]
    assert_nothing_held(router)


class LayerwiseWorker(ScriptedWorker):
    """Layer-wise: D answers a reservation, P streams into it, D decodes after the token."""

    threshold = 0  # the prefill worker's reported layerwise_min_tokens

    def _send(self, events) -> None:
        report = WorkerReport(self.name, self.role, True, 0, 0, 64, 0, 0, 0, "")
        report = replace(report, layerwise_min_tokens=self.threshold)
        self.on_batch(OutputBatch(tuple(events), report))

    async def _generate(self, item: WorkItem) -> None:
        if item.kv_stream_from and item.first_token_id is None:  # D: step 1
            self._send([self._event(item, (), finished=False, kv_reservations=(b"blocks",))])
        elif item.kv_reservations:  # P: step 2
            first = self._event(item, self.output_ids[:1], finished=True, kv_streamed=True)
            self._send([first])
        else:  # D: step 3, decode after the first token
            await super()._generate(item)


def test_the_layer_wise_order_reserves_first(tokenizer, lives):
    states, num_settled = lives
    router, _, _, output_ids = make_router(tokenizer)
    prefill = LayerwiseWorker("prefill-0", "prefill", output_ids)
    decode = LayerwiseWorker("decode-0", "decode", output_ids)
    prefill.threshold = 1
    router.prefill[0].client, router.decode[0].client = prefill, decode
    events = run(router, lambda r: ended(r, collect(r, request(request_id="l"))))
    assert [t for e in events for t in e.delta.token_ids] == output_ids[:6]
    assert [i.mode for i in decode.items] == ["decode", "decode"]
    assert [i.mode for i in prefill.items] == ["prefill"]
    assert prefill.items[0].kv_reservations == (b"blocks",)
    layerwise = ["routed", "reserving", "prefilling", "handing_off", "decoding"]
    assert states["l"] == [*layerwise, "settling", "settled"] and num_settled == {"l": 1}
    assert_nothing_held(router)


def test_illegal_transitions_are_refused_and_settle_runs_once(tokenizer):
    stream = RequestStream(
        "r", [5, 6], SamplingParams(), tokenizer, return_text=True, return_timing=False
    )
    released = []
    life = RequestLife(None, stream, NO_TRACE, None, [5, 6], released.append)  # type: ignore[arg-type]
    assert life.state is State.ADMITTED
    for state in (State.DECODING, State.HANDING_OFF, State.MIGRATING, State.SETTLED):
        with pytest.raises(IllegalTransition, match=f"r: admitted -> {state.value}"):
            life._to(state)
        assert life.state is State.ADMITTED
    work = life.settle(is_cut_short=True)
    assert life.state is State.SETTLING and life.is_aborted
    assert not life.abort()  # its stream ended: nothing to abort
    with pytest.raises(IllegalTransition):
        life.settle(is_cut_short=False)
    work.close()
    assert released == []  # the release is the coroutine's (not run here)


def test_the_transition_table_leads_from_admitted_to_settled_only():
    reachable, todo = {State.ADMITTED}, [State.ADMITTED]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reachable:
            reachable.add(nxt)
            todo.append(nxt)
    assert reachable == set(State)
    assert TRANSITIONS[State.SETTLED] == frozenset()
    for state in set(State) - {State.SETTLING, State.SETTLED}:
        assert State.SETTLING in TRANSITIONS[state], state  # every path can end
    assert TRANSITIONS[State.SETTLING] == {State.SETTLED}  # and ends one way
