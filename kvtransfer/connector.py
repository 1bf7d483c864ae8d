"""One worker rank's end of the KV hand-off: the lifetimes, on one thread.

The connector is what a worker talks to. A prefill rank ``offer``s a finished
request's blocks and gets a :class:`KVHandle`; a decode rank ``receive``s the handles
into blocks it allocated, by pulling (READ) or by asking the prefill rank to push
(WRITE). Every backend call, lease decision and deadline check happens on the
connector's own thread (``kvtransfer-<agent>``); public methods hand it closures.

Who frees what, and when (the hazards of the disaggregated flow):

- **Prefill blocks** are held by a lease (``leases.py``) from ``offer`` until each
  expected decode rank's completion notice (done / aborted / skipped / failed) or until
  the lease expires; then ``on_release(req_id, reason)`` runs *on the connector
  thread* and the worker frees the blocks (the callback must be quick and
  thread-safe: typically it queues the id for the engine loop).
- **Decode blocks** belong to the decode worker all along; the future returned by
  ``receive`` completes (result or typed error) only when no transfer targets them any
  more, so the worker may free or reuse them as soon as it completes, never before.
- A decode rank that will read nothing (abort before the transfer, full prefix hit)
  calls ``decline``; the notice frees the prefill blocks long before the lease would.
- Notices are hints keyed by (owner agent, lease id): late, duplicate or foreign ones
  do nothing. A dead peer is dropped and its incarnation refused from then on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from functools import partial

from kvtransfer.backend import KVBackend, KVTransferConfig
from kvtransfer.errors import PeerLostError, TransferTimeoutError
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable, ReleaseCallback
from kvtransfer.messages import (
    CompletionNotice,
    HandshakeMetadata,
    KVHandle,
    PushRequest,
    StreamNotice,
    StreamReservation,
    decode,
    decode_as,
    encode,
)
from kvtransfer.peers import PeerTable
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.stream import StreamSender
from kvtransfer.stream_receiver import StreamReceiver
from kvtransfer.tp_mapping import num_readers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorStats:
    num_peers: int
    num_leases: int  # prefill: requests whose blocks are held
    num_incoming: int  # decode: receives not yet completed
    num_outgoing: int  # prefill: push writes in flight
    num_streams: int = 0  # layer-wise streams open, either side


class KVConnector:
    def __init__(
        self,
        backend: KVBackend,
        layout: KVLayout,
        config: KVTransferConfig,
        worker_id: str,
        incarnation: str,
        on_release: ReleaseCallback,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.layout = layout
        self.config = config
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.direction = (
            backend.preferred_direction if config.direction == "auto" else config.direction
        )
        self._backend = backend
        self._clock = clock
        # Touched only on the connector thread:
        self._peers = PeerTable(backend, layout)
        self._receiver = Receiver(self._peers, layout, self.direction, clock)
        self._sender = Sender(self._peers, LeaseTable(on_release, clock), clock)
        self._stream_sender = StreamSender(self._peers, layout, clock)
        self._stream_receiver = StreamReceiver(self._peers, layout, clock)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"kvtransfer-{backend.name}", daemon=True
        )
        self._thread.start()
        try:
            agent_metadata = self._call(backend.open, config.handshake_timeout_s)
        except BaseException:
            self.close()
            raise
        self._metadata = encode(HandshakeMetadata(worker_id, incarnation, agent_metadata, layout))

    # ---- public API (any thread) ------------------------------------------------------
    @property
    def agent_name(self) -> str:
        return self._backend.name

    def metadata(self) -> bytes:
        """This rank's handshake metadata (msgpack); give it to peers' ``add_peer``."""
        return self._metadata

    def add_peer(self, metadata: bytes) -> str:
        """Both sides: load a peer from its ``metadata()``; returns its agent name.

        Raises LayoutMismatchError (says what differs), PeerLostError (an incarnation
        known to be dead), TransferTimeoutError. A newer incarnation of a worker
        replaces the older one.
        """
        meta = decode_as(metadata, HandshakeMetadata)
        return self._call(lambda: self._peers.add(meta), self.config.handshake_timeout_s)

    def remove_peer(self, agent_name: str) -> None:
        """Drop a peer (the control plane saw it die); its incarnation is refused afterwards."""
        self._call(lambda: self._peers.drop(agent_name, "removed"), self.config.handshake_timeout_s)

    def offer(
        self,
        req_id: str,
        block_ids: Sequence[int],
        *,
        num_tokens: int,
        first_token_id: int,
        dst_tp_size: int = 1,
        dst_pp_size: int = 1,
    ) -> KVHandle:
        """Prefill side: hold ``block_ids`` under a lease for the decode ranks and describe them.

        ``dst_tp_size`` and ``dst_pp_size`` are the decode worker's TP size and pipeline
        stages: they say how many decode ranks will read from this rank (with none, the
        blocks are released at once).
        """
        layout = self.layout
        readers = num_readers(
            layout.num_kv_heads,
            layout.tp_rank,
            layout.tp_size,
            dst_tp_size,
            src_layers=layout.layer_range,
            total_num_layers=layout.total_num_layers,
            dst_pp_size=dst_pp_size,
            is_latent=layout.is_latent,
        )
        ids = tuple(int(b) for b in block_ids)
        for block_id in ids:
            self.layout.block_addr(block_id)  # range check, on the caller's thread
        lease = self._call(
            lambda: self._sender.offer(req_id, ids, readers, self.config.lease_seconds),
            self.config.handshake_timeout_s,
        )
        return KVHandle(
            agent_name=self.agent_name,
            req_id=req_id,
            lease_id=lease.lease_id,
            block_ids=ids,
            fingerprint=self.layout.fingerprint,
            num_tokens=num_tokens,
            first_token_id=first_token_id,
            lease_seconds=self.config.lease_seconds,
            issued_unix=time.time(),
        )

    def receive(
        self, handles: Sequence[KVHandle], block_ids: Sequence[int], timeout_s: float | None = None
    ) -> Future:
        """Decode side: bring the request's KV (one handle per prefill rank) into ``block_ids``.

        Returns a Future of :class:`TransferResult`; on failure it holds a
        KVTransferError. It completes by the deadline, and only once nothing writes
        into ``block_ids`` any more: the worker frees or reuses them after that.
        """
        future: Future = Future()
        timeout = self.config.transfer_timeout_s if timeout_s is None else timeout_s
        ids, hs = tuple(int(b) for b in block_ids), tuple(handles)
        if self._closed:
            raise PeerLostError("connector is closed")
        self._commands.put((lambda: self._receiver.start(hs, ids, timeout, future), None, None))
        return future

    def abort(self, req_id: str) -> None:
        """Decode side: stop a ``receive`` or ``expect_stream`` in progress (its future fails
        with TransferAbortedError once nothing targets the blocks). Unknown ids are ignored."""

        def abort() -> None:
            self._receiver.abort(req_id)
            self._stream_receiver.abort(req_id)

        self._call(abort, self.config.handshake_timeout_s)

    # ---- layer-wise hand-off (kvtransfer/stream.py) -----------------------------------
    def expect_stream(
        self,
        req_id: str,
        block_ids: Sequence[int],
        sources: Sequence[str],
        timeout_s: float | None = None,
        first_block: int = 0,
    ) -> tuple[bytes, Future]:
        """Decode side, at admission: the prefill agents ``sources`` will write the
        request's KV into ``block_ids`` (the prompt's blocks, reserved) layer group by
        layer group; with ``first_block`` > 0 the prompt's blocks before it are this rank's
        own (a partial receive) and ``block_ids`` the rest. Returns the reservation (msgpack; the prefill ranks' ``open_stream``
        takes it) and a Future of :class:`TransferResult` that completes once every layer
        arrived, or with a KVTransferError, and only when nothing writes the blocks."""
        future: Future = Future()
        timeout = self.config.transfer_timeout_s if timeout_s is None else timeout_s
        ids, srcs = tuple(int(b) for b in block_ids), tuple(sources)
        reservation = self._call(
            lambda: self._stream_receiver.expect(req_id, ids, srcs, timeout, future, first_block),
            self.config.handshake_timeout_s,
        )
        return encode(reservation), future

    def withdraw_stream(self, req_id: str) -> None:
        """Decode side: end an ``expect_stream`` whose reservation was never given to any
        prefill rank (its future fails at once: nobody can write the blocks)."""
        fn = partial(self._stream_receiver.withdraw, req_id)
        self._call(fn, self.config.handshake_timeout_s)

    def replica_agents(self, worker_id: str) -> tuple[str, ...]:
        """The agents of every rank of replica ``worker_id`` (the sources of a stream from
        it); raises KVTransferError unless every rank is handshaken."""
        fn = partial(self._peers.replica_agents, worker_id)
        return self._call(fn, self.config.handshake_timeout_s)

    def open_stream(self, req_id: str, reservations: Sequence[bytes]) -> Future:
        """Prefill side, before the request's first chunk: write its KV to the decode
        ranks that reserved blocks (``write_layers``). The Future (bytes written) completes
        once none of its writes is in flight: free the request's blocks after it."""
        future: Future = Future()
        rs = tuple(decode_as(r, StreamReservation) for r in reservations)
        self._call(
            lambda: self._stream_sender.open(req_id, rs, future), self.config.handshake_timeout_s
        )
        return future

    def write_layers(
        self,
        req_id: str,
        first_block: int,
        block_ids: Sequence[int],
        layers: tuple[int, int],
        layers_ready: int,
        is_last: bool = False,
    ) -> None:
        """Prefill side, from the forward pass (does not wait): ``block_ids``, the prompt's
        blocks from ``first_block`` on, hold model ``layers`` now; write them. The last
        write (``is_last``) carries the stream's one notice."""
        ids = tuple(int(b) for b in block_ids)
        fn = partial(
            self._stream_sender.write, req_id, first_block, ids, layers, layers_ready, is_last
        )
        self._commands.put((fn, None, None))

    def abandon_stream(self, req_id: str, reason: str) -> None:
        """Prefill side: the request ended before its last write; its readers recompute."""
        self._commands.put((lambda: self._stream_sender.abandon(req_id, reason), None, None))

    def decline(self, handles: Sequence[KVHandle], status: str = "aborted") -> None:
        """Decode side: nothing will be read from these handles ("aborted" or "skipped",
        e.g. a full prefix hit): tell each owner now so it frees its blocks."""
        if status not in ("aborted", "skipped"):
            raise ValueError(f"decline status must be 'aborted' or 'skipped', got {status!r}")
        # Our own handles (a peer export nobody will read, declined through us): no notice
        # can reach ourselves, so the lease ends here.
        own = tuple(h for h in handles if h.agent_name == self.agent_name)
        others = tuple(h for h in handles if h.agent_name != self.agent_name)

        def decline() -> None:
            self._receiver.decline(others, status)
            for handle in own:
                self._sender.end_lease(handle.lease_id, status)

        self._call(decline, self.config.handshake_timeout_s)

    def stats(self) -> ConnectorStats:
        return self._call(
            lambda: ConnectorStats(
                len(self._peers),
                self._sender.num_leases,
                len(self._receiver),
                self._sender.num_outgoing,
                len(self._stream_sender) + len(self._stream_receiver),
            ),
            self.config.handshake_timeout_s,
        )

    def sync(self) -> None:
        """Wait until the connector thread has run one full progress pass (tests)."""
        self._call(lambda: None, self.config.handshake_timeout_s)
        self._call(lambda: None, self.config.handshake_timeout_s)

    def close(self) -> None:
        """Release every lease (reason "shutdown"), fail pending receives, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._commands.put((self._shutdown, None, True))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.config.handshake_timeout_s)

    # ---- command plumbing -------------------------------------------------------------
    def _call(self, fn: Callable, timeout: float):
        """Run ``fn`` on the connector thread and wait for its result (or exception)."""
        if self._closed:
            raise PeerLostError("connector is closed")
        future: Future = Future()
        self._commands.put((fn, future, None))
        try:
            return future.result(timeout)
        except FutureTimeoutError:
            raise TransferTimeoutError(
                f"connector thread did not answer within {timeout}s"
            ) from None

    def _run(self) -> None:
        while True:
            if len(self._receiver) or self._sender.num_outgoing or self._stream_sender.is_busy:
                timeout = self.config.active_poll_s
            elif self._sender.num_leases or len(self._stream_sender) or len(self._stream_receiver):
                # A layer-wise stream waits on the forward pass: polling it fast would
                # take the engine thread's GIL for nothing (its notice: within this).
                timeout = self.config.lease_poll_s
            else:
                timeout = self.config.idle_poll_s
            try:
                command = self._commands.get(timeout=timeout)
            except queue.Empty:
                command = None
            while command is not None:
                fn, future, stop = command
                try:
                    result = fn()
                    if future is not None and not future.done():
                        future.set_result(result)
                except BaseException as exc:
                    if future is not None and not future.done():
                        future.set_exception(exc)
                    else:
                        logger.exception("kvtransfer command failed")
                if stop is not None:
                    return
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            try:
                self._progress()
            except Exception:
                logger.exception("kvtransfer progress failed")

    def _shutdown(self) -> None:
        self._receiver.shutdown()
        self._stream_receiver.shutdown()
        self._stream_sender.shutdown()
        self._sender.shutdown()
        self._backend.close()

    def _progress(self) -> None:
        """One pass: route notifications, advance transfers, enforce deadlines and leases."""
        for sender, data in self._backend.get_notifs():
            try:
                msg = decode(data)
            except ValueError:
                logger.warning("ignoring malformed notification from %s", sender)
                continue
            if isinstance(msg, PushRequest):
                self._sender.on_push_request(sender, msg)
            elif isinstance(msg, StreamNotice):
                if msg.status == "abort":
                    self._stream_sender.on_notice(sender, msg)
                else:
                    self._stream_receiver.on_notice(sender, msg)
            elif isinstance(msg, CompletionNotice):
                if msg.owner == self.agent_name:
                    self._sender.on_notice(sender, msg)  # about one of our leases
                else:
                    self._receiver.on_notice(sender, msg)  # about one of our receives
        now = self._clock()
        self._sender.progress(now)
        self._receiver.progress(now)
        self._stream_sender.progress(now)
        self._stream_receiver.progress(now)
