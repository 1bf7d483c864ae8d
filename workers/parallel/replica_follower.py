"""A rank other than 0 (TP and/or pipeline): it does what rank 0's commands say, in order.

No scheduler, sampler or router traffic here: each :class:`RankCommand` brings the KV
operations of this rank's connector and, for a step, the forward pass's inputs, which
this rank runs on its shard of the weights and its heads of the KV cache (a pipeline
stage's layers: it receives the previous stage's activations and sends its own on).

Layer-wise hand-off (docs/kvtransfer.md): a decode rank reserves its blocks on its own
connector (``reserves``: the reservation goes back as news, then the receive's end); a
prefill rank opens the stream on its own connector (``stream_opens``) and writes its
heads of its layers after each layer group of the step's streamed chunks (the step's
``stream_chunks``, the same bookkeeping as rank 0's: ``workers/engine/layerwise.py``),
and says when its stream ended (nothing in flight: rank 0 may free the blocks then).

Its news for rank 0 (an offer's handle, a lease that ended, a receive that completed)
goes out as it happens, on a thread of its own, not in step with the commands: this
rank may be busy with a pipeline of batches when a lease ends, and rank 0 must not wait
for that (``workers/parallel/replica_kv.py`` is the other end). ``run`` returns on a stop
command and raises when the link to rank 0 breaks (rank 0 died) or a command is out of
sequence; the caller then tears the process group down so that no rank waits on it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from msgspec.structs import astuple

from kvtransfer import KVConnector, KVHandle
from kvtransfer.messages import decode_as as decode_kv
from kvtransfer.messages import encode as encode_kv
from workers.engine.layerwise import StreamChunk
from workers.engine.llm_engine import LLMEngine
from workers.parallel.rank_link import RankLink
from workers.parallel.replica_messages import (
    Offered,
    OfferOp,
    RankReply,
    Received,
    Reserved,
    ReserveOp,
    Streamed,
    StreamOpenOp,
    decode_command,
    encode_reply,
)

logger = logging.getLogger(__name__)


class RankFollower:
    def __init__(
        self, engine: LLMEngine, link: RankLink, dst_tp_size: int = 1, dst_pp_size: int = 1
    ):
        self.engine = engine
        self.link = link
        self.dst_tp_size = dst_tp_size  # prefill: the decode pool's layout (who reads us)
        self.dst_pp_size = dst_pp_size
        self.connector: KVConnector | None = None
        # News for rank 0 (Offered, a released request id, Received), from any thread;
        # None ends the sender.
        self._news: queue.SimpleQueue = queue.SimpleQueue()
        self._ended: queue.SimpleQueue = queue.SimpleQueue()  # streams whose future completed
        self.steps = 0
        self.bytes_streamed = 0  # layer-wise writes of this rank that landed (stats, tests)

    def on_release(self, request_id: str, reason: str) -> None:
        """The connector thread: this rank's lease of ``request_id`` ended."""
        self._news.put(request_id)

    def run(self) -> None:
        sender = threading.Thread(target=self._send_news, name="rank-news", daemon=True)
        sender.start()
        try:
            self._follow()
        finally:
            self._news.put(None)
            sender.join(10.0)

    def _follow(self) -> None:
        expected = 0
        while True:
            command = decode_command(self.link.receive())
            if command.seq != expected:
                raise RuntimeError(f"rank command {command.seq} arrived, {expected} expected")
            expected += 1
            self._forget_ended()
            connector = self.connector
            if connector is not None:
                for request_id in command.aborts:
                    connector.abort(request_id)
                for handles in command.declines:
                    connector.decline([decode_kv(h, KVHandle) for h in handles], "aborted")
                for request_id in command.stream_aborts:
                    self.engine.layerwise.remove(request_id)
                    connector.abandon_stream(request_id, "aborted")
                for request_id in command.withdraws:
                    connector.withdraw_stream(request_id)
            for op in command.receives:
                self._start_receive(op.handles, op.block_ids)
            for op in command.offers:
                self._news.put(self._offer(op))
            for op in command.reserves:
                self._reserve(op)
            for op in command.stream_opens:
                self._open_stream(op)
            if command.step is not None:
                hook = None
                if command.stream_chunks:
                    chunks = [StreamChunk(*astuple(c)) for c in command.stream_chunks]
                    hook = self.engine.layerwise.hook_for_chunks(chunks)
                self.engine.runner.run(command.step, hook)
                self.steps += 1
            if command.stop:
                return

    def _offer(self, op: OfferOp) -> Offered:
        try:
            if self.connector is None:
                raise RuntimeError("no KV connector on this rank")
            handle = self.connector.offer(
                op.request_id,
                op.block_ids,
                num_tokens=op.num_tokens,
                first_token_id=op.first_token_id,
                dst_tp_size=self.dst_tp_size,
                dst_pp_size=self.dst_pp_size,
            )
        except Exception as exc:
            return Offered(op.request_id, b"", f"{type(exc).__name__}: {exc}")
        return Offered(op.request_id, encode_kv(handle))

    def _start_receive(self, handles: tuple[bytes, ...], block_ids: tuple[int, ...]) -> None:
        decoded = [decode_kv(h, KVHandle) for h in handles]
        request_id = decoded[0].req_id
        try:
            if self.connector is None:
                raise RuntimeError("no KV connector on this rank")
            future = self.connector.receive(decoded, block_ids)
        except Exception as exc:
            future = Future()
            future.set_exception(exc)
        future.add_done_callback(lambda f: self._news.put(_received(request_id, f)))

    def _reserve(self, op: ReserveOp) -> None:
        """Decode: reserve this rank's blocks for the stream from every rank of
        ``op.source``; a failure is news too (and its receive ends at once)."""
        try:
            if self.connector is None:
                raise RuntimeError("no KV connector on this rank")
            sources = self.connector.replica_agents(op.source)
            reservation, future = self.connector.expect_stream(
                op.request_id, op.block_ids, sources, first_block=op.first_block
            )
        except Exception as exc:
            self._news.put(Reserved(op.request_id, b"", f"{type(exc).__name__}: {exc}"))
            future = Future()
            future.set_exception(exc)
        else:
            self._news.put(Reserved(op.request_id, reservation))
        request_id = op.request_id
        future.add_done_callback(lambda f: self._news.put(_received(request_id, f)))

    def _open_stream(self, op: StreamOpenOp) -> None:
        """Prefill: write this rank's part of the request's KV into the reservations,
        group by group as the steps compute it; rank 0 hears when nothing is in flight."""
        request_id, connector = op.request_id, self.connector
        try:
            if connector is None:
                raise RuntimeError("no KV connector on this rank")
            future = connector.open_stream(request_id, op.reservations)
        except Exception as exc:
            self._news.put(Streamed(request_id, f"{type(exc).__name__}: {exc}"))
            return

        def write(first_block, block_ids, layers, layers_ready, is_last) -> None:
            connector.write_layers(
                request_id, first_block, block_ids, layers, layers_ready, is_last
            )

        # A pipeline stage may hold fewer layers than rank 0's (the group size's basis).
        group_size = min(op.group_size, self.engine.layerwise.num_layers)
        self.engine.layerwise.add(request_id, group_size, write)
        future.add_done_callback(lambda f: self._stream_ended(request_id, f))

    def _stream_ended(self, request_id: str, future: Future) -> None:
        """The connector thread: this rank's stream of ``request_id`` has nothing in flight."""
        self._ended.put(request_id)
        exc = future.exception()
        error = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        num_bytes = 0 if exc is not None else future.result()
        self.bytes_streamed += num_bytes
        self._news.put(Streamed(request_id, error, num_bytes))

    def _forget_ended(self) -> None:
        """The command thread: streams whose end came drop out of the layer hook."""
        while True:
            try:
                self.engine.layerwise.remove(self._ended.get_nowait())
            except queue.Empty:
                return

    def _send_news(self) -> None:
        """Send what is new, batched while the previous send was going out; the last
        answer once ``None`` comes (rank 0's reader then stops)."""
        done = False
        while not done:
            items = [self._news.get()]
            while True:
                try:
                    items.append(self._news.get_nowait())
                except queue.Empty:
                    break
            done = None in items
            news = [item for item in items if item is not None]
            try:
                if news:
                    self.link.reply(encode_reply(_reply(self.link.rank, news)))
                if done:
                    self.link.reply_done()
            except Exception as exc:  # rank 0 is gone; the command loop sees it too
                logger.warning("rank %d cannot send news to rank 0: %s", self.link.rank, exc)
                return


def _received(request_id: str, future: Future) -> Received:
    exc = future.exception()
    if exc is not None:
        return Received(request_id, f"{type(exc).__name__}: {exc}")
    result = future.result()
    return Received(request_id, "", result.seconds, result.num_bytes)


def _reply(rank: int, news: list) -> RankReply:
    """Sorted by kind: rank 0 takes offers, then ended leases, then receives (then
    reservations and ended streams), so that a lease's end never comes before its offer;
    a reservation's Received may come before its Reserved (rank 0 keeps both)."""
    return RankReply(
        rank,
        offered=tuple(n for n in news if isinstance(n, Offered)),
        released=tuple(n for n in news if isinstance(n, str)),
        received=tuple(n for n in news if isinstance(n, Received)),
        reserved=tuple(n for n in news if isinstance(n, Reserved)),
        streamed=tuple(n for n in news if isinstance(n, Streamed)),
    )
