"""The worker → router event channel over real loopback sockets.

What must hold: batches arrive intact and in order (those sent before the router listens
first); only a worker that is expected and knows the token gets in; a closed or silent
worker, a frame that claims to be huge or one that is not a batch is reported once, with
why, rather than hanging; an EngineService with a sink pushes its buffered events, a
report with a snapshot of the block hashes, then heartbeats with events only on change.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
import struct
import time

import msgpack
import pytest

from cluster.tools.make_model import make_model
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.protocol.wire import (
    WIRE_VERSION,
    KVEvents,
    OutputBatch,
    TokenEvent,
    WorkerReport,
    WorkItem,
)
from workers.serving.channel import ChannelListener, ChannelSender
from workers.serving.service import EngineService


def _report(seq: int = 3, hashes: tuple[int, ...] = (7, 8)) -> WorkerReport:
    return WorkerReport(
        name="w",
        role="decode",
        healthy=True,
        num_running=1,
        num_waiting=0,
        kv_blocks_total=10,
        kv_blocks_used=2,
        kv_blocks_cached=1,
        num_held=0,
        kv_events_seq=seq,
        kv_events=(KVEvents("pool", hashes),) if hashes else (),
    )


async def _connect(listener: ChannelListener, name: str = "w", token: str | None = None):
    await listener.start()
    future = listener.expect(name)
    sender = await asyncio.to_thread(
        ChannelSender, listener.host, listener.port, name, token or listener.token
    )
    return sender, future


class _Collector:
    """What a listening router saw: the batches, and why the channel was lost."""

    def __init__(self):
        self.batches: list[OutputBatch] = []
        self.lost: list[str] = []

    async def wait(self, until, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, (self.batches, self.lost)
            await asyncio.sleep(0.01)


def _batch(i: int) -> OutputBatch:
    event = TokenEvent(f"r{i}", (i, i + 1), finished=i == 2, finish_reason="length")
    return OutputBatch((event,), _report(i, () if i else (1, 2, 3)))


def test_batches_arrive_intact_in_order_and_the_close_is_reported():
    async def main():
        listener = ChannelListener()
        sender, future = await _connect(listener)
        reader = await listener.accepted("w", future)
        sent = [_batch(i) for i in range(3)]
        sender.send(sent[0])  # before the router listens: kept, delivered first
        await asyncio.sleep(0.05)
        seen = _Collector()
        reader.listen(seen.batches.append, seen.lost.append)
        for batch in sent[1:]:
            sender.send(batch)
        await seen.wait(lambda: len(seen.batches) == 3)
        sender.close()
        await seen.wait(lambda: seen.lost)
        await listener.close()
        return sent, seen

    sent, seen = asyncio.run(main())
    assert seen.batches == sent
    assert seen.lost == ["worker w closed its event channel"]


@pytest.mark.parametrize("case", ["wrong token", "unexpected name", "not a hello"])
def test_strangers_are_refused(case):
    async def main():
        listener = ChannelListener()
        await listener.start()
        future = listener.expect("w")
        sock = socket.create_connection((listener.host, listener.port), timeout=5)
        if case == "not a hello":
            sock.sendall(struct.pack("!I", 3) + b"abc")
        else:
            name, token = ("w", "0" * 32) if case == "wrong token" else ("x", listener.token)
            hello = msgpack.packb(["hello", WIRE_VERSION, name, token])
            sock.sendall(struct.pack("!I", len(hello)) + hello)
        # The listener drops the connection: the stranger reads EOF (or a reset).
        try:
            data = await asyncio.to_thread(sock.recv, 1)
        except ConnectionResetError:
            data = b""
        sock.close()
        with pytest.raises(ConnectionError, match="did not connect"):
            await listener.accepted("w", future, timeout_s=0.2)
        await listener.close()
        return data

    assert asyncio.run(main()) == b""


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("silent", r"worker w sent nothing for 0\.2 s"),
        ("huge frame", r"worker w sent a 2147483648-byte frame"),
        ("bad frame", r"worker w sent a bad frame: not a OutputBatch message"),
    ],
)
def test_silence_and_bad_frames_lose_the_worker(case, reason):
    async def main():
        listener = ChannelListener()
        sender, future = await _connect(listener)
        reader = await listener.accepted("w", future)
        seen = _Collector()
        reader.listen(seen.batches.append, seen.lost.append, silence_s=0.2)
        if case == "huge frame":
            sender._sock.sendall(struct.pack("!I", 1 << 31))
        elif case == "bad frame":
            junk = msgpack.packb(["report", WIRE_VERSION])
            sender._sock.sendall(struct.pack("!I", len(junk)) + junk)
        await seen.wait(lambda: seen.lost)
        sender.close()
        await asyncio.sleep(0.05)
        await listener.close()
        return seen

    seen = asyncio.run(main())
    assert len(seen.lost) == 1 and re.fullmatch(reason, seen.lost[0]), seen.lost
    assert not seen.batches


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("channel") / "tiny", "llama", "tiny")
    return LLMEngine(
        EngineConfig(
            model=str(path),
            max_model_len=128,
            block_size=8,
            num_kv_blocks=64,
            detokenize=False,
        )
    )


def test_service_pushes_events_then_heartbeats(engine):
    batches: list[OutputBatch] = []
    service = EngineService(engine, "w", "decode")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        service.submit(WorkItem("r0", tuple(range(1, 20)), params, "full"))
        deadline = time.monotonic() + 30
        # Done once its blocks sit in the prefix cache, free (the engine is idle then).
        while engine.block_manager.num_cached_blocks < 2 or engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Finished before any sink: the events were kept, and arrive first on attach.
        service.attach(batches.append)
        while len(batches) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        service.stop()
    tokens = [t for b in batches for e in b.events for t in e.token_ids]
    assert len(tokens) == 4
    assert batches[0].events[-1].finished
    assert all(not b.events for b in batches[1:])  # then heartbeats
    # Block hashes go out as the pool's events: the first report is a snapshot (the two
    # full blocks of the 23 tokens), later ones carry events only when something changed.
    reports = [b.report for b in batches]
    assert reports[0].kv_events_snapshot
    (pool,) = [e for e in reports[0].kv_events if e.tier == "pool"]
    assert len(pool.stored) == 2
    for before, after in itertools.pairwise(reports):
        assert after.kv_events_seq in (before.kv_events_seq, before.kv_events_seq + 1)
        assert bool(after.kv_events) == (after.kv_events_seq != before.kv_events_seq)
