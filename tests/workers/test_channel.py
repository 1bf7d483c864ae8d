"""The worker → router event channel over real loopback sockets.

What must hold: batches arrive intact and in order; only a worker that is expected and
knows the token gets in; a closed or silent worker, or a frame that claims to be huge,
is reported as a ConnectionError rather than a hang; an EngineService with a sink pushes
its buffered events, a report with the block hashes, then heartbeats without them.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
import time

import pytest

from workers import SamplingParams
from workers.channel import ChannelListener, ChannelSender
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.make_model import make_model
from workers.service import EngineService
from workers.wire import OutputBatch, TokenEvent, WorkerReport, WorkItem


def _report(version: int = 3, hashes: tuple[int, ...] | None = (7, 8)) -> WorkerReport:
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
        hashes_version=version,
        cached_hashes=hashes,
    )


async def _connect(listener: ChannelListener, name: str = "w", token: str | None = None):
    await listener.start()
    future = listener.expect(name)
    sender = await asyncio.to_thread(
        ChannelSender, listener.host, listener.port, name, token or listener.token
    )
    return sender, future


def test_batches_arrive_intact_and_in_order():
    async def main():
        listener = ChannelListener()
        sender, future = await _connect(listener)
        reader = await listener.accepted("w", future)
        sent = [
            OutputBatch(
                (TokenEvent(f"r{i}", (i, i + 1), finished=i == 2, finish_reason="length"),),
                _report(i, None if i else (1, 2, 3)),
            )
            for i in range(3)
        ]
        for batch in sent:
            sender.send(batch)
        got = [await reader.next_batch() for _ in sent]
        sender.close()
        with pytest.raises(ConnectionError, match="closed its event channel"):
            await reader.next_batch()
        await listener.close()
        return sent, got

    sent, got = asyncio.run(main())
    assert got == sent


@pytest.mark.parametrize("case", ["wrong token", "unexpected name"])
def test_strangers_are_refused(case):
    async def main():
        listener = ChannelListener()
        await listener.start()
        future = listener.expect("w")
        name, token = ("w", "0" * 32) if case == "wrong token" else ("x", listener.token)
        sender = await asyncio.to_thread(ChannelSender, listener.host, listener.port, name, token)
        # The listener closes the connection: the stranger reads EOF.
        sender._sock.settimeout(5)
        data = await asyncio.to_thread(sender._sock.recv, 1)
        with pytest.raises(ConnectionError, match="did not connect"):
            await listener.accepted("w", future, timeout_s=0.2)
        sender.close()
        await listener.close()
        return data

    assert asyncio.run(main()) == b""


def test_silence_and_oversized_frames_are_errors():
    async def main():
        listener = ChannelListener()
        sender, future = await _connect(listener)
        reader = await listener.accepted("w", future)
        started = time.monotonic()
        with pytest.raises(ConnectionError, match=r"sent nothing for 0\.2 s"):
            await reader.next_batch(silence_s=0.2)
        waited = time.monotonic() - started
        sender._sock.sendall(struct.pack("!I", 1 << 31))
        with pytest.raises(ConnectionError, match="byte frame"):
            await reader.next_batch()
        sender.close()
        await listener.close()
        return waited

    assert 0.15 < asyncio.run(main()) < 5


def test_a_hello_that_is_not_one_is_refused():
    async def main():
        listener = ChannelListener()
        await listener.start()
        future = listener.expect("w")
        sock = socket.create_connection((listener.host, listener.port), timeout=5)
        sock.sendall(struct.pack("!I", 3) + b"abc")
        data = await asyncio.to_thread(sock.recv, 1)
        sock.close()
        assert not future.done()
        await listener.close()
        return data

    assert asyncio.run(main()) == b""


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
    # Block hashes go out in the first report and again only when they change.
    reports = [b.report for b in batches]
    assert reports[0].cached_hashes is not None
    for before, after in itertools.pairwise(reports):
        changed = after.hashes_version != before.hashes_version
        assert (after.cached_hashes is not None) == changed
    # The two full blocks of the 23 tokens are cached.
    assert len([r.cached_hashes for r in reports if r.cached_hashes is not None][-1]) == 2
