"""Layer-wise hand-off, decode side: blocks reserved at admission, written by the prefill
ranks as their layers are computed (connector thread only; the protocol and who frees
what: ``stream.py``).

A receive completes when every source (a prefill rank holding some of our heads and
layers) has said "done" (the notice rides on its last write, posted after its earlier
writes completed), and fails when one said "failed" / "aborted" or the deadline passed.
On a failure the other sources are asked to "abort"; the future completes only once
each has answered or the deadline has passed (theirs is half of ours, counted from
later), so that nothing writes the blocks afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvtransfer.backend import TransferResult
from kvtransfer.errors import (
    KVTransferError,
    PeerLostError,
    TransferAbortedError,
    TransferTimeoutError,
    error_from_code,
)
from kvtransfer.layout import KVLayout
from kvtransfer.messages import StreamNotice, StreamReservation, encode
from kvtransfer.peers import PeerTable
from kvtransfer.tp_mapping import latent_block_sources


@dataclass
class _InStream:
    req_id: str
    future: Future
    deadline: float  # connector clock
    started: float  # perf_counter
    sources: dict[str, str]  # agent -> waiting | done | failed | aborted | lost
    num_bytes: int = 0
    num_writes: int = 0
    error: KVTransferError | None = None
    abort_sent: bool = False


class StreamReceiver:
    def __init__(self, peers: PeerTable, layout: KVLayout, clock: Callable[[], float]):
        self._peers = peers
        self._layout = layout
        self._clock = clock
        self._streams: dict[str, _InStream] = {}
        peers.on_drop(self._peer_lost)

    def __len__(self) -> int:
        return len(self._streams)

    def expect(
        self,
        req_id: str,
        block_ids: Sequence[int],
        sources: Sequence[str],
        timeout: float,
        future: Future,
        first_block: int = 0,
    ) -> StreamReservation:
        """Wait for ``req_id``'s KV from the prefill agents ``sources`` into ``block_ids``
        (reserved: the prompt's blocks from ``first_block`` on, in order; the ones before
        are this rank's own prefix-cache hits); returns the reservation they need."""
        if req_id in self._streams:
            raise ValueError(f"request {req_id!r} is already being received")
        for block_id in block_ids:
            self._layout.block_addr(block_id)
        waiting, num_bytes = {}, 0
        for name in sources:
            peer = self._peers.get(name)
            if peer is None:
                raise PeerLostError(f"no handshake with {name} (or it died)")
            if peer.stream_read_segments:  # it holds some of our heads and layers
                waiting[name] = "waiting"
                num_blocks = self._num_blocks_from(peer.meta.layout, first_block, len(block_ids))
                num_bytes += num_blocks * sum(s.length for s in peer.stream_read_segments)
        if not waiting:
            raise ValueError("no source holds any of this rank's kv heads")
        now = self._clock()
        inc = _InStream(req_id, future, now + timeout, time.perf_counter(), waiting, num_bytes)
        self._streams[req_id] = inc
        name = self._peers.backend.name
        return StreamReservation(name, req_id, tuple(block_ids), timeout, first_block)

    def _num_blocks_from(self, src: KVLayout, first_block: int, num_blocks: int) -> int:
        """How many of our blocks prefill rank ``src`` writes: all, or for a latent cache
        its round-robin share (``stream.py``)."""
        if not self._layout.is_latent:
            return num_blocks
        ranks = range(src.tp_size)
        shares = latent_block_sources(first_block, num_blocks, ranks, self._layout.tp_rank)
        return len(shares[src.tp_rank])

    def on_notice(self, sender: str, notice: StreamNotice) -> None:
        inc = self._streams.get(notice.req_id)
        if inc is None or inc.sources.get(sender) != "waiting" or notice.status == "abort":
            return  # late, duplicate or foreign: harmless
        inc.sources[sender] = notice.status
        inc.num_writes += notice.num_writes
        if notice.status == "failed":
            error = error_from_code(notice.error_code, notice.message or "stream failed")
            inc.error = inc.error or error
        elif notice.status == "aborted":
            inc.error = inc.error or TransferAbortedError(f"{sender} stopped the stream")
        self._progress_one(inc, self._clock())

    def abort(self, req_id: str) -> None:
        inc = self._streams.get(req_id)
        if inc is not None and inc.error is None:
            inc.error = TransferAbortedError(f"request {req_id!r} aborted")

    def withdraw(self, req_id: str) -> None:
        """The reservation never left this worker (another rank of the replica could not
        reserve): no writer has it, so the receive ends now, without waiting for answers."""
        inc = self._streams.get(req_id)
        if inc is not None:
            self._finish(inc, TransferAbortedError(f"reservation of {req_id!r} withdrawn"))

    def shutdown(self) -> None:
        for inc in list(self._streams.values()):
            self._finish(inc, PeerLostError("connector closed"))

    def progress(self, now: float) -> None:
        for inc in list(self._streams.values()):
            self._progress_one(inc, now)

    def _progress_one(self, inc: _InStream, now: float) -> None:
        waiting = [name for name, state in inc.sources.items() if state == "waiting"]
        if not waiting:
            self._finish(inc, inc.error)
            return
        if now >= inc.deadline:
            # Past our deadline, hence past each writer's (half of ours, from later).
            self._finish(inc, inc.error or TransferTimeoutError(f"KV of {inc.req_id!r} late"))
            return
        if inc.error is not None and not inc.abort_sent:
            for name in waiting:  # ask the writers to stop; they answer "aborted"
                self._send(name, StreamNotice(inc.req_id, "abort"))
            inc.abort_sent = True

    def _send(self, name: str, notice: StreamNotice) -> None:
        try:
            self._peers.backend.send_notif(name, encode(notice))
        except PeerLostError as exc:
            self._peers.drop(name, str(exc))
        except KVTransferError:
            pass  # the writer stops at its own deadline

    def _peer_lost(self, name: str, error: PeerLostError) -> None:
        for inc in self._streams.values():
            if inc.sources.get(name) == "waiting":
                inc.sources[name] = "lost"  # its endpoint is closed: nothing more lands
                inc.error = inc.error or error

    def _finish(self, inc: _InStream, error: KVTransferError | None) -> None:
        self._streams.pop(inc.req_id, None)
        if inc.future.done():
            return
        if error is not None:
            inc.future.set_exception(error)
            return
        seconds = time.perf_counter() - inc.started
        # num_descriptors: the writes the sources made (each a merged descriptor list)
        inc.future.set_result(
            TransferResult(inc.req_id, "push", inc.num_bytes, inc.num_writes, seconds)
        )
