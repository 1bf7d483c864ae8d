"""Layer-wise hand-off: a prefill rank writes a request's KV, layer group by layer group,
into blocks a decode rank reserved at admission (connector thread only).

Decode (``StreamReceiver``) reserves: it gives the prefill ranks a
:class:`StreamReservation` (its blocks) and waits. Prefill (``StreamSender``) WRITEs each
layer group of each finished chunk as soon as the forward pass has stored it
(``write``), without a notification; the stream's last write carries the only "done"
notice and is posted once every earlier write of the stream has completed, so the
notice arrives after all the data. Notifications are O(1) per request. A latent cache
(MLA), whole on every prefill rank of a stage, is written round robin: each block by
one of them (``_latent_share``); every one still ends its part with "done".

Who frees what:

- **Decode blocks** are the decode worker's; the receive's future completes only once
  no write can land in them any more: every source said "done", "failed" or "aborted"
  (each sends "failed" / "aborted" only once none of its writes is in flight), or the
  deadline passed (the writers' own deadline is half of ours, counted from later).
- **Prefill blocks** are the prefill request's own; the stream's future (from ``open``)
  completes once none of its writes is in flight, so the worker frees the blocks after
  it, never before. Nothing is leased: nobody reads them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtransfer.errors import (
    KVTransferError,
    PeerLostError,
    TransferAbortedError,
    TransferTimeoutError,
)
from kvtransfer.layout import KVLayout
from kvtransfer.messages import StreamNotice, StreamReservation, encode
from kvtransfer.peers import PeerTable
from kvtransfer.tp_mapping import latent_block_sources, segments_for_layers

# The prefill side stops writing after this fraction of the decode side's timeout.
STREAM_WRITE_FRACTION = 0.5


@dataclass
class _Out:
    """One decode rank's share of a request's stream, on the prefill side."""

    reservation: StreamReservation
    in_flight: list[object] = field(default_factory=list)
    last: tuple | None = None  # the stream's last write, held until the others completed
    num_writes: int = 0
    num_bytes: int = 0
    state: str = "open"  # open | done | failed | aborted
    is_finishing: bool = False  # the last write (with the "done" notice) is posted
    error: KVTransferError | None = None
    abort_requested: bool = False

    @property
    def reader(self) -> str:
        return self.reservation.agent_name


@dataclass
class _OutStream:
    req_id: str
    outs: list[_Out]
    deadline: float
    future: Future
    layers_ready: int = 0


class StreamSender:
    def __init__(self, peers: PeerTable, layout: KVLayout, clock: Callable[[], float]):
        self._peers = peers
        self._backend = peers.backend
        self._layout = layout
        self._clock = clock
        self._streams: dict[str, _OutStream] = {}
        peers.on_drop(self._peer_lost)

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def is_busy(self) -> bool:
        """A write is in flight or waits to be posted (the connector polls fast then;
        between a stream's writes it need not: the engine thread computes meanwhile)."""
        return any(
            out.in_flight or out.last is not None
            for stream in self._streams.values()
            for out in stream.outs
        )

    def open(self, req_id: str, reservations: Sequence[StreamReservation], future: Future) -> None:
        """Start writing ``req_id`` to the reservations' decode ranks (those holding some of
        our heads and layers); ``future`` completes when nothing of it is in flight."""
        if req_id in self._streams:
            raise ValueError(f"request {req_id!r} is already streaming")
        outs = []
        for reservation in reservations:
            if reservation.req_id != req_id:
                raise ValueError("all reservations of a stream must be for one request")
            peer = self._peers.get(reservation.agent_name)
            if peer is None:
                raise PeerLostError(f"no handshake with {reservation.agent_name} (or it died)")
            if peer.stream_write_segments:
                outs.append(_Out(reservation))
        timeout = min((r.timeout_s for r in reservations), default=0.0)
        deadline = self._clock() + timeout * STREAM_WRITE_FRACTION
        stream = _OutStream(req_id, outs, deadline, future)
        self._streams[req_id] = stream
        self._maybe_finish(stream)

    def write(
        self,
        req_id: str,
        first_block: int,
        block_ids: Sequence[int],
        layers: tuple[int, int],
        layers_ready: int,
        is_last: bool,
    ) -> None:
        """Our ``block_ids`` (the prompt's blocks from ``first_block`` on) hold model layers
        ``layers`` now: write them into each reader's reserved blocks. ``is_last``: the
        stream's final write (its notice says "done")."""
        stream = self._streams.get(req_id)
        if stream is None:
            return  # abandoned or ended: nothing more goes out
        stream.layers_ready = max(stream.layers_ready, layers_ready)
        for out in stream.outs:
            if out.state != "open" or out.error is not None or out.abort_requested:
                continue
            # The reader holds the prompt's blocks before its first_block (partial receive).
            skip = max(out.reservation.first_block - first_block, 0)
            src = tuple(block_ids[skip:])
            start = first_block + skip - out.reservation.first_block
            dst = out.reservation.block_ids[start : start + len(src)]
            if len(dst) != len(src):
                out.error = KVTransferError(
                    f"{len(out.reservation.block_ids)} reserved blocks for block "
                    f"{first_block + len(block_ids) - 1} of {req_id!r}"
                )
                continue
            if self._layout.is_latent:  # our round-robin share of the blocks only
                share = self._latent_share(out, first_block + skip, len(src))
                src, dst = tuple(src[i] for i in share), [dst[i] for i in share]
            write = (src, tuple(dst), layers)
            if is_last:
                out.last = write
            else:
                self._post(out, write, b"")
        self._progress_one(stream, self._clock())

    def abandon(self, req_id: str, reason: str) -> None:
        """The prefill request ended before its last write (aborted, failed): stop; the
        readers get "failed" once nothing is in flight (they recompute)."""
        stream = self._streams.get(req_id)
        if stream is None:
            return
        for out in stream.outs:
            if out.state == "open" and out.error is None:
                out.error = TransferAbortedError(f"prefill of {req_id!r} ended: {reason}")
        self._progress_one(stream, self._clock())

    def on_notice(self, sender: str, notice: StreamNotice) -> None:
        """A reader asks us to stop ("abort")."""
        stream = self._streams.get(notice.req_id)
        if stream is None or notice.status != "abort":
            return
        for out in stream.outs:
            if out.reader == sender:
                out.abort_requested = True

    def shutdown(self) -> None:
        for stream in list(self._streams.values()):
            for out in stream.outs:
                for xfer in out.in_flight:
                    self._backend.cancel(xfer)
                out.in_flight.clear()
                out.state = "failed" if out.state == "open" else out.state
            self._streams.pop(stream.req_id, None)
            if not stream.future.done():
                stream.future.set_exception(PeerLostError("connector closed"))

    def progress(self, now: float) -> None:
        for stream in list(self._streams.values()):
            self._progress_one(stream, now)

    # ---- internals ----------------------------------------------------------------------
    def _latent_share(self, out: _Out, first_block: int, num_blocks: int) -> tuple[int, ...]:
        """Positions of the prompt blocks ``first_block ..`` that this prefill rank writes
        to ``out``'s reader: a latent cache is whole on every rank of our stage, so each
        block comes from one of them, ``(block + decode rank) % prefill TP`` (the same
        round robin as the whole-request hand-off, ``tp_mapping.latent_block_sources``)."""
        peer = self._peers.get(out.reader)
        if peer is None:
            return ()
        layout = self._layout
        shares = latent_block_sources(
            first_block, num_blocks, range(layout.tp_size), peer.meta.layout.tp_rank
        )
        return shares[layout.tp_rank]

    def _post(self, out: _Out, write: tuple, notif: bytes) -> bool:
        """Post one WRITE; False (and nothing posted) when the reader holds none of
        these layers."""
        src, dst, layers = write
        if not src:
            return False
        peer = self._peers.get(out.reader)
        segments = (
            segments_for_layers(peer.stream_write_segments, self._layout, layers) if peer else ()
        )
        if not segments:
            return False
        try:
            xfer = self._backend.post(out.reader, "WRITE", src, dst, notif, layers)
        except PeerLostError as exc:
            out.error = out.error or exc
            self._peers.drop(out.reader, str(exc))
            return False
        except KVTransferError as exc:
            out.error = out.error or exc
            return False
        out.in_flight.append(xfer)
        out.num_writes += 1
        out.num_bytes += len(src) * sum(s.length for s in segments)
        return True

    def _progress_one(self, stream: _OutStream, now: float) -> None:
        for out in stream.outs:
            if out.state == "open":
                self._progress_out(stream, out, now)
        self._maybe_finish(stream)

    def _progress_out(self, stream: _OutStream, out: _Out, now: float) -> None:
        stopping = out.error is not None or out.abort_requested or now >= stream.deadline
        still = []
        for xfer in out.in_flight:
            try:
                if stopping and self._backend.cancel(xfer):
                    continue
                if not self._backend.check(xfer):
                    still.append(xfer)
            except PeerLostError as exc:
                out.error = out.error or exc
                out.in_flight, out.state = [], "failed"
                self._peers.drop(out.reader, str(exc))
                return
            except KVTransferError as exc:
                out.error = out.error or exc
        out.in_flight = still
        if still and now >= stream.deadline:
            # Writes that can neither finish nor stop by the deadline: dropping the peer
            # closes the endpoint, so nothing reads our blocks afterwards (as push does).
            self._peers.drop(out.reader, "stream write could not be stopped")
            return
        if still:
            return
        if out.error is None and out.is_finishing:
            out.state = "done"  # the last write completed: its "done" notice went with it
        elif out.abort_requested or out.error is not None or now >= stream.deadline:
            status = "aborted" if out.abort_requested else "failed"
            error = out.error or TransferTimeoutError(f"stream of {stream.req_id!r} timed out")
            out.error, out.state = error, status
            code = getattr(error, "code", "")
            self._notify(
                out, StreamNotice(stream.req_id, status, out.num_writes, 0, code, str(error))
            )
        elif out.last is not None:  # every earlier write completed: the data is there
            last, out.last = out.last, None
            done = StreamNotice(stream.req_id, "done", out.num_writes + 1, stream.layers_ready)
            if self._post(out, last, encode(done)):
                out.is_finishing = True
            elif out.error is None:  # no byte of these layers for this reader
                done = StreamNotice(stream.req_id, "done", out.num_writes, stream.layers_ready)
                self._notify(out, done)
                out.state = "done"

    def _notify(self, out: _Out, notice: StreamNotice) -> None:
        if self._peers.get(out.reader) is None:
            return
        try:
            self._backend.send_notif(out.reader, encode(notice))
        except PeerLostError as exc:
            self._peers.drop(out.reader, str(exc))
        except KVTransferError:
            pass  # the reader's deadline ends its receive

    def _maybe_finish(self, stream: _OutStream) -> None:
        if any(out.state == "open" for out in stream.outs):
            return
        del self._streams[stream.req_id]
        if stream.future.done():
            return
        failed = [out.error for out in stream.outs if out.state != "done"]
        if failed:
            stream.future.set_exception(failed[0])
        else:
            stream.future.set_result(sum(out.num_bytes for out in stream.outs))

    def _peer_lost(self, name: str, error: PeerLostError) -> None:
        for stream in self._streams.values():
            for out in stream.outs:
                if out.reader == name and out.state == "open":
                    for xfer in out.in_flight:
                        self._backend.cancel(xfer)
                    out.in_flight, out.state, out.error = [], "failed", error
