"""Rank 0's bookkeeping of a replica's layer-wise streams (docs/kvtransfer.md): every
rank's part, on the loop thread, no I/O (``replica_kv.py`` sends the commands).

- **Decode, reserving**: every rank reserves its blocks on its own connector (its heads
  of its layers, written by the prefill ranks that hold them); the request's
  reservations go out once every rank has one, in rank order (``reserving``). The
  receive's end is ``ReplicaKV``'s, as for a read: every rank's part completed.
- **Prefill, streaming**: every rank writes its heads of its layers from its own copy
  of the blocks; the stream's future completes once *every* rank's has (``streaming``):
  the block ids are shared, so rank 0 frees them (``KVHandoff.stream_ended``) only when
  no rank's write reads them any more. It fails if any rank's part failed.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtransfer.errors import TransferFailedError
from workers.parallel.replica_messages import Reserved, Streamed


@dataclass
class _Reserving:
    future: Future  # every rank's reservation (msgpack), in rank order
    reservations: list[bytes | None]  # by rank; rank 0's is known at once
    errors: list[str] = field(default_factory=list)


@dataclass
class _Streaming:
    future: Future  # what the worker waits on: every rank's stream ended
    local: Future  # rank 0's (bytes written)
    ranks_left: set[int]
    errors: list[str] = field(default_factory=list)
    num_bytes: int = 0


class ReplicaStreams:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._reserving: dict[str, _Reserving] = {}
        self._streaming: dict[str, _Streaming] = {}

    @property
    def pending(self) -> bool:
        return bool(self._reserving or self._streaming)

    def reserving(self, request_id: str, local: bytes) -> Future:
        """Decode: rank 0 reserved (``local``); the future's result is every rank's
        reservation, or it fails if a rank could not reserve."""
        entry = _Reserving(Future(), [local] + [None] * (self.world_size - 1))
        self._reserving[request_id] = entry
        self._settle_reserving(request_id)
        return entry.future

    def reserved(self, rank: int, news: Reserved) -> None:
        entry = self._reserving.get(news.request_id)
        if entry is None or entry.reservations[rank] is not None:
            return
        if news.error:
            entry.errors.append(f"rank {rank}: {news.error}")
        entry.reservations[rank] = news.reservation
        self._settle_reserving(news.request_id)

    def streaming(self, request_id: str, local: Future) -> Future:
        """Prefill: rank 0's stream is open (``local``); the future completes once every
        rank's stream has ended (the result: the bytes all ranks wrote)."""
        entry = _Streaming(Future(), local, set(range(1, self.world_size)))
        self._streaming[request_id] = entry
        return entry.future

    def streamed(self, rank: int, news: Streamed) -> bool:
        """A rank's stream ended; True when it is the stream's first failure (the caller
        stops the other ranks' parts: their readers then fail at once, not at their
        deadline, when a rank could not even open its part)."""
        entry = self._streaming.get(news.request_id)
        if entry is None or rank not in entry.ranks_left:
            return False
        entry.ranks_left.discard(rank)
        entry.num_bytes += news.num_bytes
        if not news.error:
            return False
        entry.errors.append(f"rank {rank}: {news.error}")
        return len(entry.errors) == 1

    def settle(self) -> None:
        """Complete the streams whose every part ended."""
        for request_id, entry in list(self._streaming.items()):
            if entry.ranks_left or not entry.local.done():
                continue
            del self._streaming[request_id]
            exc = entry.local.exception()
            if exc is not None:
                entry.errors.insert(0, f"rank 0: {type(exc).__name__}: {exc}")
            if exc is not None and len(entry.errors) == 1:
                entry.future.set_exception(exc)  # keep the typed error of a lone rank
            elif entry.errors:
                entry.future.set_exception(TransferFailedError("; ".join(entry.errors)))
            else:
                entry.future.set_result(entry.local.result() + entry.num_bytes)

    def _settle_reserving(self, request_id: str) -> None:
        entry = self._reserving[request_id]
        if any(r is None for r in entry.reservations):
            return
        del self._reserving[request_id]
        if entry.errors:
            entry.future.set_exception(RuntimeError("; ".join(entry.errors)))
        else:
            entry.future.set_result(tuple(entry.reservations))
