"""Rank 0's view of a replica's KV hand-off: its own connector and the other ranks'.

Every rank of a replica has its own KV connector (its own NIXL agent over its own
cache, holding its own heads of its pipeline stage's layers), so each decode rank pulls
exactly the heads and layers it owns from the prefill ranks that hold them
(``kvtransfer/tp_mapping.py``).
Rank 0 coordinates, on the engine loop's thread (the only thread that talks to the
other ranks):

- **offer** (prefill): every rank puts its copy of the blocks under a lease; the
  request's handles are one per rank. The blocks are freed (``on_release``) only when
  the lease has ended on *every* rank: the blocks ids are shared, and a decode rank may
  still be reading one rank's copy after another rank's lease ended.
- **receive** (decode): every rank pulls its part; the request's future completes when
  all parts have, and fails if any part failed (then the whole prompt is recomputed or
  the request fails, as ``on_failure`` says; nothing is admitted half-received).
- **abort** / **decline** go to every rank.

The other ranks' news (handles, ended leases, finished receives) comes back in the
replies to rank 0's commands: rank 0 asks for replies while anything is outstanding
on them, at least every ``POLL_S``, and sends an empty command at least every
``HEARTBEAT_S`` so that a dead rank is noticed (its link closes) within that time.
With one rank there is no link and everything is local.

**Batches in flight** (pipeline stages, ``bind_engine``): rank 0 sends a batch's step
command while earlier batches are still in the pipeline. A rank of rank 0's own stage
reads each command only after running the batches before it with rank 0, so rank 0 may
wait for the other ranks (a reply, a send) only up to the oldest batch still in flight.
A round that needs replies (an offer; news owed) first *drains* the pipeline: the
engine completes every batch in flight. A step's command never asks for replies while
other batches are in flight; the next poll does.
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
from workers.rank_link import RankLink
from workers.replica import leave_replica
from workers.replica_messages import (
    OfferOp,
    RankCommand,
    RankReply,
    ReceiveOp,
    decode_reply,
    encode_command,
)
from workers.step_inputs import StepInputs

logger = logging.getLogger(__name__)

POLL_S = 0.002  # how often rank 0 asks the other ranks while they owe it news
HEARTBEAT_S = 0.5  # an idle replica still exchanges a command this often


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
        self._receiving: dict[str, _Receiving] = {}
        self._seq = 0
        self._last_round = time.monotonic()
        # The engine's batches in flight: how many, and how to complete them all.
        self._in_flight: Callable[[], int] = lambda: 0
        self._drain: Callable[[], None] = lambda: None
        self._step_msgs: deque[int] = deque(maxlen=64)  # link numbers of step commands
        self.rounds = 0  # commands sent (stats, tests)

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

    def local_released(self, request_id: str, reason: str) -> None:
        """Rank 0's connector thread: its lease ended."""
        self._local_released.put((request_id, reason))
        self._wake()

    # ---- the loop thread ---------------------------------------------------------------
    def before_forward(self, inputs: StepInputs) -> None:
        """The engine's hook: the other ranks run the same forward pass."""
        self._round(step=inputs)

    def offer(
        self, request_id: str, block_ids: Sequence[int], *, num_tokens: int, first_token_id: int
    ) -> tuple[bytes, ...]:
        """Leases on every rank; the handles in rank order. Raises (no lease counts) if
        any rank cannot offer; the caller frees the blocks, since no handle went out."""
        connector = self._require()
        self._holds[request_id] = set(range(self.world_size))
        try:
            local = connector.offer(
                request_id,
                block_ids,
                num_tokens=num_tokens,
                first_token_id=first_token_id,
                dst_tp_size=self.dst_tp_size,
                dst_pp_size=self.dst_pp_size,
            )
            handles = [encode_kv(local)]
            if self.link is not None:
                op = OfferOp(request_id, tuple(block_ids), num_tokens, first_token_id)
                replies = self._round(offers=(op,))
                for reply in replies:
                    offered = reply.offered[0]
                    if offered.error:
                        raise RuntimeError(f"rank {reply.rank}: {offered.error}")
                    handles.append(offered.handle)
        except Exception:
            # Leases that did start end by expiry; their blocks are freed by the caller.
            del self._holds[request_id]
            raise
        return tuple(handles)

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
    def owed(self) -> bool:
        """Another rank owes news (a lease or a receive is open there)."""
        return any(len(h) > (0 in h) for h in self._holds.values()) or any(
            r.ranks_left for r in self._receiving.values()
        )

    def wait_hint(self) -> float | None:
        """How long the loop may sleep before it must ``poll`` again (None: no limit)."""
        if self.link is None:
            return None
        return POLL_S if self.owed else HEARTBEAT_S

    def poll(self) -> None:
        """Take in rank 0's ended leases and receives; ask the other ranks when due."""
        while True:
            try:
                request_id, reason = self._local_released.get_nowait()
            except queue.Empty:
                break
            self._released(request_id, 0, reason)
        for request_id in list(self._receiving):
            self._settle(request_id)
        if self.link is not None:
            since = time.monotonic() - self._last_round
            if since >= HEARTBEAT_S or (self.owed and since >= POLL_S):
                self._round()

    def close(self) -> None:
        """Tell the other ranks to stop (the loop is ending)."""
        if self.link is not None:
            self._drain()
            self._round(stop=True)
            self.link.settle()

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

    def _round(self, step: StepInputs | None = None, **ops) -> list[RankReply]:
        """One command to every other rank; their replies when any were needed."""
        assert self.link is not None
        reply = bool(ops.get("offers")) or self.owed
        in_flight = self._in_flight()  # not counting the batch of ``step``
        if reply and in_flight:
            if step is not None:
                reply = False  # the next poll asks, once the pipeline drained
            else:
                self._drain()
                in_flight = 0
        command = RankCommand(seq=self._seq, step=step, reply=reply, **ops)
        self._seq += 1
        self.rounds += 1
        number = self.link.send(encode_command(command))
        if step is not None:
            self._step_msgs.append(number)
            in_flight += 1
        # Safe to wait for: what the other ranks read before the oldest batch in flight.
        self.link.settle(self._step_msgs[-in_flight] if in_flight else None)
        self._last_round = time.monotonic()
        if not reply:
            return []
        raw = self.link.gather(b"")
        assert raw is not None
        replies = [decode_reply(data) for data in raw[1:]]
        for reply_msg in replies:
            for request_id in reply_msg.released:
                self._released(request_id, reply_msg.rank, "released")
            for received in reply_msg.received:
                entry = self._receiving.get(received.request_id)
                if entry is None or reply_msg.rank not in entry.ranks_left:
                    continue
                entry.ranks_left.discard(reply_msg.rank)
                if received.error:
                    entry.errors.append(f"rank {reply_msg.rank}: {received.error}")
                entry.seconds = max(entry.seconds, received.seconds)
                entry.num_bytes += received.num_bytes
                self._wake()
        return replies

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
