"""Send a benchmark's requests to a router over gRPC and time every streamed message.

One ``grpc.aio`` channel carries every request (HTTP/2 multiplexes the streams). Each
request is sent at its arrival offset, after waiting for a slot when ``max_concurrency``
is set; its clock starts when it is sent. Times are ``time.perf_counter`` on this
process, as a user of the service sees them: TTFT is send → the first message carrying a
token, ITL the gaps between later token-carrying messages (one gap per message, however
many tokens it carries, as ``vllm bench serve`` counts them), E2E send → the final
message. A request that ends with a gRPC error is recorded with the status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from cluster.client import call_metadata, make_request
from cluster.loadgen.datasets import BenchRequest
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds."""

    index: int
    prompt_len: int
    max_tokens: int
    send_s: float = 0.0  # after the start of the run
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_len: int = 0
    cached_prompt_tokens: int = 0
    prefill_worker: str = ""  # empty: prefilled on the decode worker
    decode_worker: str = ""  # where the router sent it (spread across replicas)
    error: str = ""  # the gRPC status code name; empty = completed
    session: int | None = None  # multi-turn: the session and its turn (0 = the first)
    turn: int | None = None
    # Multi-turn: a digest of the reply's token ids, so that two runs of the same sessions
    # (say, with and without a cache tier) can be compared token for token.
    output_digest: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.e2e_s is not None


async def generate_one(
    stub: pb_grpc.InferenceStub,
    req: BenchRequest,
    record: RequestRecord,
    start: float,
    ignore_eos: bool,
    disaggregation: str | None,
    timeout_s: float | None,
    reply: list[int] | None = None,
) -> None:
    """Send ``req``, filling ``record``; the output token ids are appended to ``reply``
    when given (a multi-turn session's next prompt carries them)."""
    message = make_request(
        list(req.prompt_ids),
        max_tokens=req.max_tokens,
        temperature=0.0,
        ignore_eos=ignore_eos,
        disaggregation=disaggregation,
        return_timing=True,  # the workers it ran on
    )
    sent = time.perf_counter()
    record.send_s = sent - start
    last: float | None = None
    try:
        async for resp in stub.Generate(message, timeout=timeout_s, metadata=call_metadata()):
            now = time.perf_counter()
            delta = resp.final.delta if resp.HasField("final") else resp.delta
            if delta.token_ids:
                if last is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last)
                last = now
                record.output_len += len(delta.token_ids)
                if reply is not None:
                    reply.extend(delta.token_ids)
            if resp.HasField("final"):
                record.e2e_s = now - sent
                record.cached_prompt_tokens = resp.final.usage.cached_prompt_tokens
                record.prefill_worker = resp.final.timing.prefill_worker
                record.decode_worker = resp.final.timing.decode_worker
                if resp.final.finish_reason == pb.FINISH_REASON_ABORT:
                    record.error = "ABORTED"
    except grpc.aio.AioRpcError as exc:
        record.error = exc.code().name
    if record.e2e_s is None and not record.error:
        record.error = "NO_FINAL"  # the stream ended without its final message


async def run_requests(
    target: str,
    requests: list[BenchRequest],
    offsets: list[float],
    *,
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    disaggregation: str | None = None,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its offset; returns the records (in request order) and the
    run's duration (start → the last request's end)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(req: BenchRequest, record: RequestRecord, start: float) -> None:
            await generate_one(stub, req, record, start, ignore_eos, disaggregation, timeout_s)

        return await drive(requests, offsets, one, max_concurrency, on_done)


SendOne = Callable[[BenchRequest, RequestRecord, float], Awaitable[None]]


async def drive(
    requests: list[BenchRequest],
    offsets: list[float],
    one: SendOne,
    max_concurrency: int | None,
    on_done: Callable[[RequestRecord], None] | None,
) -> tuple[list[RequestRecord], float]:
    """Send request i with ``one`` at ``offsets[i]`` (after a slot frees, with
    ``max_concurrency``); every backend's schedule. Returns the records and the duration."""
    if len(offsets) != len(requests):
        raise ValueError("one arrival offset per request")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(i, len(r.prompt_ids), r.max_tokens) for i, r in enumerate(requests)]
    start = time.perf_counter()

    async def send(i: int) -> None:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        async with slots or contextlib.nullcontext():
            await one(requests[i], records[i], start)
        if on_done is not None:
            on_done(records[i])

    await asyncio.gather(*(send(i) for i in range(len(requests))))
    return records, time.perf_counter() - start
