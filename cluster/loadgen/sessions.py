"""Send a multi-turn workload (:mod:`cluster.loadgen.multiturn`): each session is a
coroutine that starts at its arrival offset and sends its turns one after another, each
turn's prompt built from the replies the server gave to the turns before it, with the
session's think time between a reply's end and the next turn.

``max_sessions`` caps the sessions in progress (a session holds its place through its
think times; the next one starts when one ends), ``max_concurrency`` the requests in
flight. A turn that fails ends its session: its later turns are recorded as failed with
``SESSION_ENDED`` (their prompts would need the reply that never came).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable

import grpc

from cluster.loadgen.datasets import BenchRequest
from cluster.loadgen.multiturn import MultiTurnWorkload, history
from cluster.loadgen.runner import RequestRecord, generate_one
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

# (request, its record, the run's start, the list the reply's token ids go to)
SendTurn = Callable[[BenchRequest, RequestRecord, float, list[int]], Awaitable[None]]
SESSION_ENDED = "SESSION_ENDED"


def reply_digest(token_ids: list[int]) -> str:
    """16 hex digits that differ, in practice, between any two different replies."""
    data = b"".join(t.to_bytes(4, "little") for t in token_ids)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def turn_records(workload: MultiTurnWorkload) -> list[RequestRecord]:
    """One record per turn, session by session (``index`` in that order)."""
    records = []
    for i, s in enumerate(workload.sessions):
        for t in range(s.num_turns):
            records.append(RequestRecord(len(records), 0, s.max_tokens[t], session=i, turn=t))
    return records


async def drive_sessions(
    workload: MultiTurnWorkload,
    offsets: list[float],
    send: SendTurn,
    *,
    max_concurrency: int | None = None,
    max_sessions: int | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run every session (session ``i`` no earlier than ``offsets[i]``) with ``send``;
    returns the records (see :func:`turn_records`) and the duration (start → last end)."""
    if len(offsets) != len(workload.sessions):
        raise ValueError("one arrival offset per session")
    records = turn_records(workload)
    first = [0]
    for s in workload.sessions[:-1]:
        first.append(first[-1] + s.num_turns)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    places = asyncio.Semaphore(max_sessions) if max_sessions else None
    start = time.perf_counter()

    def done(record: RequestRecord) -> None:
        if on_done is not None:
            on_done(record)

    async def session(i: int) -> None:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        s = workload.sessions[i]
        async with places or contextlib.nullcontext():
            replies: list[list[int]] = []
            for t in range(s.num_turns):
                if t:
                    await asyncio.sleep(s.think_s[t - 1])
                record = records[first[i] + t]
                prompt = history(workload, i, replies)
                record.prompt_len = len(prompt)
                reply: list[int] = []
                async with slots or contextlib.nullcontext():
                    await send(BenchRequest(prompt, s.max_tokens[t]), record, start, reply)
                done(record)
                if not record.ok:
                    for later in records[first[i] + t + 1 : first[i] + s.num_turns]:
                        later.error = SESSION_ENDED
                        done(later)
                    return
                record.output_digest = reply_digest(reply)
                replies.append(reply)

    await asyncio.gather(*(session(i) for i in range(len(workload.sessions))))
    return records, time.perf_counter() - start


async def run_sessions(
    target: str,
    workload: MultiTurnWorkload,
    offsets: list[float],
    *,
    max_concurrency: int | None = None,
    max_sessions: int | None = None,
    ignore_eos: bool = False,
    disaggregation: str | None = None,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """:func:`drive_sessions` over gRPC to the router at ``target`` (one channel)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def send(
            req: BenchRequest, record: RequestRecord, start: float, reply: list[int]
        ) -> None:
            await generate_one(
                stub, req, record, start, ignore_eos, disaggregation, timeout_s, reply
            )

        return await drive_sessions(
            workload,
            offsets,
            send,
            max_concurrency=max_concurrency,
            max_sessions=max_sessions,
            on_done=on_done,
        )
