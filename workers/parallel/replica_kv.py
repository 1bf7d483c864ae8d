"""Rank 0's view of a replica's KV hand-off: its own connector and the other ranks'.

Every rank of a replica has its own KV connector (its own NIXL agent over its own
cache, holding its own heads of its pipeline stage's layers), so each decode rank pulls
exactly the heads and layers it owns from the prefill ranks that hold them
(``kvtransfer/tp_mapping.py``).
Rank 0 coordinates, on the engine loop's thread (the only thread that sends to the
other ranks):

- **offer** (prefill): every rank puts its copy of the blocks under a lease; the
  request's handles are one per rank, and the offer's future completes when every rank
  has answered. ``on_release`` (whose caller frees the blocks: ``KVHandoff.lease_ended``)
  comes only when the lease has ended on *every* rank: the blocks ids are shared, and a
  decode rank may still be reading one rank's copy after another rank's lease ended.
- **receive** (decode): every rank pulls its part; the request's future completes when
  all parts have, and fails if any part failed (then the whole prompt is recomputed or
  the request fails, as ``on_failure`` says; nothing is admitted half-received).
- **abort** / **decline** go to every rank.
- **layer-wise** (``expect_stream``, ``open_stream``): every rank reserves, or writes, its
  own heads of its own layers; reservations and a stream's end wait for every rank
  (``replica_streams.py``); each step's streamed chunks travel with its command.

The other ranks' news (handles, ended leases, finished receives) comes back on its own,
as it happens (``workers/parallel/rank_link.py``); ``poll`` takes it in. Rank 0 never waits for
it, so nothing here stops the engine: with pipeline stages, batches stay in flight while
hand-offs are open. An idle replica still sends an empty command every ``HEARTBEAT_S``,
so that a dead rank is noticed (the send to it fails) within that time. With one rank
there is no link and everything is local.

What is kept here is per rank only (whose lease is alive, whose handle or part has
come); a request's hand-off state, and who frees its blocks, is the engine's
``KVHandoff`` (``workers/engine/handoff.py``).

**Batches in flight** (pipeline stages, ``bind_engine``): rank 0 sends a batch's step
command while earlier batches are still in the pipeline. A rank of rank 0's own stage
reads each command only after running the batches before it with rank 0, so rank 0
waits for its sends to arrive only up to the oldest batch still in flight.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtransfer import KVConnector, KVHandle, TransferResult
from kvtransfer.errors import TransferFailedError
from kvtransfer.messages import decode_as as decode_kv
from kvtransfer.messages import encode as encode_kv
from workers.engine.layerwise import LayerwiseStreams, StreamChunk
from workers.engine.step_inputs import StepInputs
from workers.parallel.rank_link import RankLink
from workers.parallel.replica import leave_replica
from workers.parallel.replica_messages import (
    OfferOp,
    RankCommand,
    RankReply,
    ReceiveOp,
    ReserveOp,
    StreamChunkOp,
    StreamOpenOp,
    decode_reply,
    encode_command,
)
from workers.parallel.replica_streams import ReplicaStreams

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # an idle replica still sends a command this often
_GOODBYE_S = 10.0  # at stop, how long rank 0 waits for the other ranks' last news


@dataclass
class _Offering:
    future: Future  # what the service waits on: every rank's handle, in rank order
    handles: list[bytes | None]  # by rank; rank 0's is known at once
    errors: list[str] = field(default_factory=list)


@dataclass
class _Receiving:
    future: Future  # what the service waits on: all ranks' parts
    local: Future  # rank 0's part
    ranks_left: set[int]  # other ranks whose part has not completed
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    num_bytes: int = 0


class ReplicaKV:
    def __init__(self, link: RankLink | None = None, dst_tp_size: int = 1, dst_pp_size: int = 1):
        self.link = link
        self.world_size = link.world_size if link is not None else 1
        self.dst_tp_size = dst_tp_size  # prefill: the decode pool's layout (who reads us)
        self.dst_pp_size = dst_pp_size
        self._connector: KVConnector | None = None
        self._on_release: Callable[[str, str], None] = lambda rid, reason: None
        self._wake: Callable[[], None] = lambda: None
        self._local_released: queue.SimpleQueue = queue.SimpleQueue()
        self._holds: dict[str, set[int]] = {}  # prefill: ranks whose lease is alive
        self._offering: dict[str, _Offering] = {}
        self._receiving: dict[str, _Receiving] = {}
        self._seq = 0
        self._last_round = time.monotonic()
        # The engine's batches in flight: how many, and how to complete them all.
        self._in_flight: Callable[[], int] = lambda: 0
        self._drain: Callable[[], None] = lambda: None
        self._step_msgs: deque[int] = deque(maxlen=64)  # link numbers of step commands
        self.streams = ReplicaStreams(self.world_size)
        self._launched: Callable[[], Sequence[StreamChunk]] = lambda: ()
        self.rounds = 0  # commands sent (stats, tests)
        if link is not None:  # the other ranks' news, read from now on; wakes the loop
            link.start_replies(lambda: self._wake())

    def bind(
        self,
        connector: KVConnector | None,
        on_release: Callable[[str, str], None],
        wake: Callable[[], None],
    ) -> None:
        """``on_release(request_id, reason)`` runs on the loop thread once every rank's
        lease of the request has ended; ``wake`` nudges the loop (any thread)."""
        self._connector = connector
        self._on_release = on_release
        self._wake = wake

    def bind_engine(self, in_flight: Callable[[], int], drain: Callable[[], None]) -> None:
        """The engine's batches in flight (``LLMEngine.num_in_flight``, ``drain``)."""
        self._in_flight = in_flight
        self._drain = drain

    def bind_streams(self, layerwise: LayerwiseStreams) -> None:
        """The engine's layer-wise streams: each step's streamed chunks go to the other
        ranks with it (``LayerwiseStreams.take_launched``)."""
        self._launched = layerwise.take_launched

    def local_released(self, request_id: str, reason: str) -> None:
        """Rank 0's connector thread: its lease ended."""
        self._local_released.put((request_id, reason))
        self._wake()

    # ---- the loop thread ---------------------------------------------------------------
    def before_forward(self, inputs: StepInputs) -> None:
        """The engine's hook: the other ranks run the same forward pass (and the same
        layer-wise writes, of their heads and layers)."""
        chunks = tuple(
            StreamChunkOp(c.request_id, c.start_pos, c.num_tokens, c.num_prompt_tokens, c.block_ids)
            for c in self._launched()
        )
        self._round(step=inputs, stream_chunks=chunks)

    def offer(
        self, request_id: str, block_ids: Sequence[int], *, num_tokens: int, first_token_id: int
    ) -> Future:
        """Leases on every rank; the future's result is the handles in rank order. It fails
        (no lease counts) if any rank cannot offer; the caller then frees the blocks,
        since no handle went out. Raises only if a rank is gone (the replica fails)."""
        future: Future = Future()
        try:
            local = self._require().offer(
                request_id,
                block_ids,
                num_tokens=num_tokens,
                first_token_id=first_token_id,
                dst_tp_size=self.dst_tp_size,
                dst_pp_size=self.dst_pp_size,
            )
        except Exception as exc:
            future.set_exception(exc)
            return future
        self._holds[request_id] = set(range(self.world_size))
        entry = _Offering(future, [encode_kv(local)] + [None] * (self.world_size - 1))
        self._offering[request_id] = entry
        if self.link is not None:
            self._round(offers=(OfferOp(request_id, tuple(block_ids), num_tokens, first_token_id),))
        self._settle_offer(request_id)
        return future

    def receive(self, handles: Sequence[bytes], block_ids: Sequence[int]) -> Future:
        """Every rank's part of the request's KV into ``block_ids``; the Future's result is
        a TransferResult over all ranks, or an error once no rank writes the blocks."""
        connector = self._require()
        decoded = [decode_kv(h, KVHandle) for h in handles]
        request_id = decoded[0].req_id
        local = connector.receive(decoded, block_ids)
        entry = _Receiving(Future(), local, set(range(1, self.world_size)))
        self._receiving[request_id] = entry
        local.add_done_callback(lambda _f: self._wake())
        if self.link is not None:
            self._round(receives=(ReceiveOp(request_id, tuple(handles), tuple(block_ids)),))
        self._settle(request_id)
        return entry.future

    def expect_stream(
        self, request_id: str, block_ids: Sequence[int], source: str, first_block: int = 0
    ) -> tuple[Future, Future]:
        """Decode, layer-wise: every rank reserves ``block_ids`` for the stream from every
        rank of the prefill replica ``source``. Returns (every rank's reservation, in rank
        order; or an error: then ``abort`` the request), and the receive's future (as
        ``receive``'s). Raises if rank 0 cannot reserve (nothing is reserved then)."""
        connector = self._require()
        sources = connector.replica_agents(source)
        reservation, local = connector.expect_stream(
            request_id, block_ids, sources, first_block=first_block
        )
        if self.link is None:
            done: Future = Future()
            done.set_result((reservation,))
            return done, local
        reservations = self.streams.reserving(request_id, reservation)
        entry = _Receiving(Future(), local, set(range(1, self.world_size)))
        self._receiving[request_id] = entry
        local.add_done_callback(lambda _f: self._wake())
        self._round(reserves=(ReserveOp(request_id, source, tuple(block_ids), first_block),))
        return reservations, entry.future

    def open_stream(
        self, request_id: str, reservations: Sequence[bytes], group_size: int
    ) -> Future:
        """Prefill, layer-wise: every rank writes its part of the request's KV into the
        decode ranks' ``reservations``, ``group_size`` layers at a time. The future (bytes)
        completes once no rank's write is in flight: free the blocks after it. Raises if
        rank 0 cannot open (nothing opened then)."""
        local = self._require().open_stream(request_id, reservations)
        if self.link is None:
            return local
        future = self.streams.streaming(request_id, local)
        local.add_done_callback(lambda _f: self._wake())
        self._round(stream_opens=(StreamOpenOp(request_id, tuple(reservations), group_size),))
        return future

    def withdraw_stream(self, request_id: str) -> None:
        """Decode: the reservations never went out; every rank's receive ends at once."""
        self._require().withdraw_stream(request_id)
        if self.link is not None:
            self._round(withdraws=(request_id,))

    def abandon_stream(self, request_id: str, reason: str) -> None:
        """Prefill: the request ended before its last write; every rank stops (their
        readers hear "failed")."""
        self._require().abandon_stream(request_id, reason)
        if self.link is not None:
            self._round(stream_aborts=(request_id,))

    def abort(self, request_id: str) -> None:
        self._require().abort(request_id)
        if self.link is not None:
            self._round(aborts=(request_id,))

    def decline(self, handles: Sequence[bytes]) -> None:
        """Nothing will be read from these handles, on any rank: their owners free now."""
        self._require().decline([decode_kv(h, KVHandle) for h in handles], "aborted")
        if self.link is not None:
            self._round(declines=(tuple(handles),))

    @property
    def pending(self) -> bool:
        """An offer or a receive waits for some rank."""
        return bool(self._offering or self._receiving or self.streams.pending)

    def wait_hint(self) -> float | None:
        """How long the loop may sleep before it must ``poll`` again (None: no limit).
        News from the other ranks wakes it sooner."""
        return None if self.link is None else HEARTBEAT_S

    def poll(self) -> None:
        """Take in ended leases and finished receives (rank 0's and the other ranks'
        news); send the heartbeat when due. Raises if a rank is gone."""
        while True:
            try:
                request_id, reason = self._local_released.get_nowait()
            except queue.Empty:
                break
            self._released(request_id, 0, reason)
        if self.link is not None:
            for data in self.link.take_replies():
                self._take(decode_reply(data))
            if time.monotonic() - self._last_round >= HEARTBEAT_S:
                self._round()
        for request_id in list(self._receiving):
            self._settle(request_id)
        self.streams.settle()

    def close(self) -> None:
        """Tell the other ranks to stop (the loop is ending), and take their last news."""
        if self.link is not None:
            self._drain()
            self._round(stop=True)
            self.link.settle()
            if not self.link.join_replies(_GOODBYE_S):
                logger.warning("some ranks sent no last news within %g s", _GOODBYE_S)

    def abandon(self) -> None:
        """Rank 0's loop died: close the link, so that the other ranks' next collective
        fails at once instead of waiting for a command that will not come."""
        if self.link is not None:
            try:
                leave_replica()
            except Exception:
                logger.warning("could not leave the replica's process group", exc_info=True)

    # ---- internals ---------------------------------------------------------------------
    def _require(self) -> KVConnector:
        if self._connector is None:
            raise RuntimeError("no KV connector on this worker")
        return self._connector

    def _round(self, step: StepInputs | None = None, **ops) -> None:
        """One command to every other rank."""
        assert self.link is not None
        in_flight = self._in_flight()  # not counting the batch of ``step``
        command = RankCommand(seq=self._seq, step=step, **ops)
        self._seq += 1
        self.rounds += 1
        number = self.link.send(encode_command(command))
        if step is not None:
            self._step_msgs.append(number)
            in_flight += 1
        # Safe to wait for: what the other ranks read before the oldest batch in flight.
        self.link.settle(self._step_msgs[-in_flight] if in_flight else None)
        self._last_round = time.monotonic()

    def _take(self, reply: RankReply) -> None:
        """One rank's news: offers first, then ended leases (never before their offer),
        then receives."""
        for offered in reply.offered:
            entry = self._offering.get(offered.request_id)
            if entry is None or entry.handles[reply.rank] is not None:
                continue
            if offered.error:
                entry.errors.append(f"rank {reply.rank}: {offered.error}")
            entry.handles[reply.rank] = offered.handle
            self._settle_offer(offered.request_id)
        for request_id in reply.released:
            self._released(request_id, reply.rank, "released")
        for received in reply.received:
            entry = self._receiving.get(received.request_id)
            if entry is None or reply.rank not in entry.ranks_left:
                continue
            entry.ranks_left.discard(reply.rank)
            if received.error:
                entry.errors.append(f"rank {reply.rank}: {received.error}")
            entry.seconds = max(entry.seconds, received.seconds)
            entry.num_bytes += received.num_bytes
        for reserved in reply.reserved:
            self.streams.reserved(reply.rank, reserved)
        for streamed in reply.streamed:
            if self.streams.streamed(reply.rank, streamed):
                self.abandon_stream(streamed.request_id, f"rank {reply.rank} failed")

    def _settle_offer(self, request_id: str) -> None:
        """Complete an offer's future once every rank has answered."""
        entry = self._offering[request_id]
        if any(handle is None for handle in entry.handles):
            return
        del self._offering[request_id]
        if entry.errors:
            # Leases that did start end by expiry; the caller frees the blocks now
            # (KVHandoff.offer_failed), and their late ends are ignored (_released).
            self._holds.pop(request_id, None)
            entry.future.set_exception(RuntimeError("; ".join(entry.errors)))
        else:
            entry.future.set_result(tuple(entry.handles))

    def _released(self, request_id: str, rank: int, reason: str) -> None:
        holders = self._holds.get(request_id)
        if holders is None:
            return  # an offer that failed: the blocks were freed already
        holders.discard(rank)
        if not holders:
            del self._holds[request_id]
            self._on_release(request_id, reason)

    def _settle(self, request_id: str) -> None:
        """Complete a receive's future once every rank's part has completed."""
        entry = self._receiving[request_id]
        if entry.ranks_left or not entry.local.done():
            return
        del self._receiving[request_id]
        exc = entry.local.exception()
        if exc is not None:
            entry.errors.insert(0, f"rank 0: {type(exc).__name__}: {exc}")
        if entry.errors:
            if exc is not None and len(entry.errors) == 1:
                entry.future.set_exception(exc)  # keep the typed error of a lone rank
            else:
                entry.future.set_exception(TransferFailedError("; ".join(entry.errors)))
            return
        local: TransferResult = entry.local.result()
        entry.future.set_result(
            TransferResult(
                req_id=request_id,
                direction=local.direction,
                num_bytes=local.num_bytes + entry.num_bytes,
                num_descriptors=local.num_descriptors,
                seconds=max(local.seconds, entry.seconds),
            )
        )
