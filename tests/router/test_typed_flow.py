"""The router's flow driven with its own types, no gRPC and no engine: a typed
``GenerateRequest`` in, ``GenerateEvent`` out, ``RouterError`` with an ``ErrorCode``.

The workers are scripted fakes: a prefill worker answers with the first token and a KV
handle, a decode worker (or a worker doing the whole request) streams the rest one token
per batch and honours aborts. What must hold: a disaggregated request is the prefill
worker's first token followed by the decode worker's tokens, the decode work carries the
handle and that token; exactly the last event has a Finish with usage and timing; stop
strings and aborts end the stream and the request on its worker; bad input and refusals
raise the same codes and messages as through gRPC.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from cluster.tools.make_model import build_tokenizer
from router.config import RouterConfig
from router.errors import ErrorCode, RouterError
from router.events import Finish, GenerateEvent, Usage
from router.requests import GenerateRequest, OutputOptions, SamplingOptions, StoppingOptions
from router.router import Router
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.wire import OutputBatch, TokenEvent, WorkerReport, WorkItem
from workers.text.tokenizer import Tokenizer

PROMPT = "Once upon a time"
OUTPUT = " there lived a curious engineer who built a router"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


class ScriptedWorker:
    """A WorkerClient whose engine 'generates' ``output_ids`` (over again), one token per batch.

    Prefill work ends with the first token and a handle; decode work continues after
    ``first_token_id``; full work streams them all. Generation stops at ``max_tokens``
    (finish reason ``length``) or at an abort (``abort``, no more tokens).
    """

    def __init__(self, name: str, role: str, output_ids: list[int], with_logprobs=False):
        self.name, self.role = name, role
        self.output_ids = output_ids
        self.with_logprobs = with_logprobs
        self.items: list[WorkItem] = []
        self.aborted: list[str] = []
        self.declined: list[tuple[bytes, ...]] = []
        self.on_batch = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None: ...

    def listen(self, on_batch, on_lost) -> None:
        self.on_batch = on_batch
        self._send(())

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def submit(self, item: WorkItem) -> None:
        self.items.append(item)
        task = asyncio.get_running_loop().create_task(self._generate(item))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def decline(self, handles: tuple[bytes, ...]) -> None:
        self.declined.append(handles)

    def _send(self, events) -> None:
        report = WorkerReport(self.name, self.role, True, 0, 0, 64, 0, 0, 0, "")
        self.on_batch(OutputBatch(tuple(events), report))

    def _event(self, item: WorkItem, token_ids=(), **fields) -> TokenEvent:
        logprobs = None
        if self.with_logprobs and token_ids:
            logprobs = tuple(TokenLogprobs(t, -0.5, 1, (t,), (-0.5,)) for t in token_ids)
        n = len(item.prompt_token_ids)
        return TokenEvent(
            item.request_id, tuple(token_ids), num_prompt_tokens=n, logprobs=logprobs, **fields
        )

    async def _generate(self, item: WorkItem) -> None:
        rid = item.request_id
        max_tokens = item.params.max_tokens or len(self.output_ids)
        if item.mode == "prefill":
            handles = (b"kv-" + rid.encode(),)
            self._send([self._event(item, self.output_ids[:1], finished=True, kv_handles=handles)])
            return
        start = 1 if item.mode == "decode" else 0
        for i in range(start, max_tokens):
            await asyncio.sleep(0.001)
            if rid in self.aborted:
                self._send([self._event(item, (), finished=True, finish_reason="abort")])
                return
            is_last = i == max_tokens - 1
            reason = "length" if is_last else None
            token_id = self.output_ids[i % len(self.output_ids)]
            self._send([self._event(item, (token_id,), finished=is_last, finish_reason=reason)])


def make_router(tokenizer: Tokenizer, disaggregation="always", **config):
    output_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    prefill = ScriptedWorker("prefill-0", "prefill", output_ids, **config.pop("workers", {}))
    decode = ScriptedWorker("decode-0", "decode", output_ids, with_logprobs=prefill.with_logprobs)
    cfg = RouterConfig(
        model_name="tiny",
        architecture="LlamaForCausalLM",
        dtype="float32",
        max_model_len=256,
        vocab_size=tokenizer.vocab_size,
        block_size=8,
        disaggregation=disaggregation,
        **config,
    )
    return Router(cfg, tokenizer, [prefill], [decode]), prefill, decode, output_ids


def run(router: Router, body):
    async def main():
        await router.start(ready_timeout_s=5)
        try:
            return await body(router)
        finally:
            await router.stop()

    return asyncio.run(main())


async def collect(router: Router, req: GenerateRequest) -> list[GenerateEvent]:
    return [event async for event in router.generate(req)]


async def settled(router: Router) -> None:
    """Wait until the router has settled every request (ended it on its worker)."""
    for _ in range(500):
        if not router.num_in_flight:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests still in flight")


def request(max_tokens=6, **fields) -> GenerateRequest:
    fields.setdefault("stopping", StoppingOptions(max_tokens=max_tokens))
    fields.setdefault("sampling", SamplingOptions(temperature=0.0))
    return GenerateRequest(PROMPT, **fields)


def test_disaggregated_request_streams_typed_events(tokenizer):
    router, prefill, decode, output_ids = make_router(tokenizer)
    req = request(
        request_id="r1",
        output=OutputOptions(return_timing=True),
        stopping=StoppingOptions(max_tokens=6),
    )
    events = run(router, lambda r: collect(r, req))

    assert [e.finish is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert all(e.request_id == "r1" for e in events)
    tokens = [t for e in events for t in e.delta.token_ids]
    assert tokens == output_ids[:6]
    assert events[0].delta.token_ids == (output_ids[0],)  # the prefill worker's, at once
    text = "".join(e.delta.text for e in events)
    assert text == tokenizer.backend.decode(output_ids[:6])
    finish = events[-1].finish
    prompt_ids = tokenizer.encode(PROMPT)
    assert finish.reason == "length" and finish.stop_string is None
    assert finish.usage == Usage(len(prompt_ids), 6, 0)
    assert finish.timing.prefill_worker == "prefill-0" and finish.timing.decode_worker == "decode-0"
    assert finish.timing.ttft_seconds <= finish.timing.e2e_seconds
    (p_item,), (d_item,) = prefill.items, decode.items
    assert (p_item.mode, d_item.mode) == ("prefill", "decode")
    assert p_item.prompt_token_ids == d_item.prompt_token_ids == tuple(prompt_ids)
    assert d_item.kv_handles == (b"kv-r1",) and d_item.first_token_id == output_ids[0]
    assert p_item.params.temperature == 0.0 and p_item.params.max_tokens == 6


def test_text_off_timing_off_and_logprobs_of_kept_tokens(tokenizer):
    router, _, decode, output_ids = make_router(tokenizer, "never", workers={"with_logprobs": True})
    req = request(max_tokens=3, output=OutputOptions(logprobs=1, return_text=False))
    events = run(router, lambda r: collect(r, req))
    assert all(e.delta.text == "" for e in events)
    assert events[-1].finish.timing is None
    logprobs = [lp for e in events for lp in e.delta.logprobs]
    assert [lp.token_id for lp in logprobs] == output_ids[:3]
    assert decode.items[0].mode == "full" and decode.items[0].params.logprobs == 1


def test_a_stop_string_ends_the_stream_and_the_request_on_its_worker(tokenizer):
    router, _, decode, _ = make_router(tokenizer)
    req = request(max_tokens=20, stopping=StoppingOptions(max_tokens=20, stop=("engineer",)))

    async def body(r):
        events = await collect(r, req)
        await settled(r)  # after the stream ended, the request is aborted on its worker
        return events

    events = run(router, body)
    finish = events[-1].finish
    assert finish == Finish("stop", finish.usage, stop_string="engineer")
    assert "".join(e.delta.text for e in events) == " there lived a curious "
    assert decode.aborted == [events[-1].request_id]


def test_abort_ends_the_stream_with_an_abort_finish(tokenizer):
    router, _, decode, output_ids = make_router(tokenizer, "never")

    async def body(r):
        events: list[GenerateEvent] = []

        async def consume():
            async for event in r.generate(request(max_tokens=10, request_id="a1")):
                events.append(event)

        task = asyncio.ensure_future(consume())
        while not events:
            await asyncio.sleep(0.001)
        assert await r.abort("a1")
        await task
        found_again = await r.abort("a1")
        await settled(r)
        return events, found_again

    events, found_again = run(router, body)
    assert events[-1].finish.reason == "abort" and not found_again
    assert [t for e in events for t in e.delta.token_ids] == output_ids[: len(events) - 1]
    assert decode.aborted == ["a1"]


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request(sampling=SamplingOptions(top_p=7.0)), "sampling.top_p: top_p must be in (0, 1]"),
        (GenerateRequest(None), "prompt: set either text or token_ids"),
        (GenerateRequest(()), "token_ids: the prompt is empty"),
        (GenerateRequest("hi", model="other"), "model: unknown model 'other'"),
        (request(disaggregation="sometimes"), "disaggregation: one of"),
        (GenerateRequest((5, 10**6)), "token_ids: ids out of vocabulary"),
        (request(max_tokens=300), "stopping.max_tokens: prompt ("),
        (
            request(stopping=StoppingOptions(ignore_eos=1)),  # type: ignore[arg-type]
            "stopping.ignore_eos: ignore_eos must be a bool",
        ),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(tokenizer, req, message):
    router, prefill, decode, _ = make_router(tokenizer)

    async def body(r):
        with pytest.raises(RouterError) as info:
            await collect(r, req)
        return info.value

    error = run(router, body)
    assert error.code is ErrorCode.INVALID_ARGUMENT and error.message.startswith(message)
    assert not prefill.items and not decode.items


def test_refusals_carry_their_code(tokenizer):
    router, _, _, _ = make_router(tokenizer, max_queued_requests=1)

    async def body(r):
        codes = []
        slow = asyncio.ensure_future(collect(r, request(max_tokens=40, request_id="slow")))
        await asyncio.sleep(0.01)
        for req in (request(request_id="slow"), request()):
            with pytest.raises(RouterError) as info:
                await collect(r, req)
            codes.append(info.value.code)
        await r.abort("slow")
        await slow
        r.is_draining = True
        with pytest.raises(RouterError) as info:
            await collect(r, request())
        codes.append(info.value.code)
        return codes

    # The id in use is judged first, then admission, then draining refuses everything.
    assert run(router, body) == [
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.RESOURCE_EXHAUSTED,
        ErrorCode.UNAVAILABLE,
    ]


def test_a_worker_error_is_internal_and_its_text_stays_in_the_log(tokenizer, caplog):
    router, _, decode, _ = make_router(tokenizer, "never")

    async def failing_generate(item: WorkItem) -> None:
        decode._send([decode._event(item, (), finished=True, finish_reason="abort", error="oom")])

    decode._generate = failing_generate

    async def body(r):
        with pytest.raises(RouterError) as info:
            await collect(r, request())
        return info.value

    error = run(router, body)
    assert error.code is ErrorCode.INTERNAL
    found = re.fullmatch(
        r"the request failed on a worker \(error ([0-9a-f]{32}); the server's log has the "
        r"details\)",
        error.message,
    )
    assert found, error.message
    (line,) = [r.getMessage() for r in caplog.records if found[1] in r.getMessage()]
    assert line.endswith("failed on worker decode-0 [error " + found[1] + "]: oom")
