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

from kvtransfer.backend import KVBackend, KVTransferConfig
from kvtransfer.errors import PeerLostError, TransferTimeoutError
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable, ReleaseCallback
from kvtransfer.messages import (
    CompletionNotice,
    HandshakeMetadata,
    KVHandle,
    PushRequest,
    decode,
    decode_as,
    encode,
)
from kvtransfer.peers import PeerTable
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.tp_mapping import num_readers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorStats:
    num_peers: int
    num_leases: int  # prefill: requests whose blocks are held
    num_incoming: int  # decode: receives not yet completed
    num_outgoing: int  # prefill: push writes in flight


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
        """Decode side: stop a ``receive`` in progress (its future fails with TransferAbortedError
        once nothing targets the blocks). Unknown ids are ignored."""
        self._call(lambda: self._receiver.abort(req_id), self.config.handshake_timeout_s)

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
            if len(self._receiver) or self._sender.num_outgoing:
                timeout = self.config.active_poll_s
            elif self._sender.num_leases:
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
            elif isinstance(msg, CompletionNotice):
                if msg.owner == self.agent_name:
                    self._sender.on_notice(sender, msg)  # about one of our leases
                else:
                    self._receiver.on_notice(sender, msg)  # about one of our receives
        now = self._clock()
        self._sender.progress(now)
        self._receiver.progress(now)
