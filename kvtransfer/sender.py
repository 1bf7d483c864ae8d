"""Prefill side: leases on offered blocks, and push writes (connector thread only).

The blocks of an offered request stay under a lease (``leases.py``) until every
expected reader's notice or expiry. In push mode a reader's PushRequest starts one
WRITE from the lease's blocks into the reader's; the write defers expiry, has its own
deadline (half the reader's timeout, so it is over before the reader stops waiting)
and ends with a "done" notice riding on the WRITE, or with a "failed"/"aborted" one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerLostError,
    TransferTimeoutError,
)
from kvtransfer.leases import Lease, LeaseTable
from kvtransfer.messages import CompletionNotice, PushRequest, encode
from kvtransfer.peers import PeerTable

# The prefill side gives up a push write after this fraction of the decode side's
# timeout, so that when the decode side stops waiting no write can still land.
PUSH_WRITE_FRACTION = 0.5


@dataclass
class Outgoing:
    """One push write in flight."""

    lease_id: int
    req_id: str
    reader: str
    xfer: object
    deadline: float
    abort_requested: bool = False


class Sender:
    def __init__(self, peers: PeerTable, leases: LeaseTable, clock: Callable[[], float]):
        self._peers = peers
        self._backend = peers.backend
        self._leases = leases
        self._clock = clock
        self._outgoing: dict[tuple[int, str], Outgoing] = {}  # (lease_id, reader)
        peers.on_drop(self._peer_lost)

    @property
    def name(self) -> str:
        return self._backend.name

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_outgoing(self) -> int:
        return len(self._outgoing)

    def offer(self, req_id: str, block_ids, num_readers: int, lease_seconds: float) -> Lease:
        return self._leases.add(req_id, block_ids, num_readers, lease_seconds)

    def end_lease(self, lease_id: int, status: str) -> None:
        """We decline our own lease (nobody will read it): it ends now, unless one of our
        writes from it is in flight (then a reader has it, and that write ends it)."""
        self._leases.end(lease_id, status)

    def shutdown(self) -> None:
        self._leases.release_all("shutdown")

    # ---- events -------------------------------------------------------------------------
    def on_notice(self, sender: str, notice: CompletionNotice) -> None:
        """A reader is done with one of our leases (or asks to stop its push write)."""
        out = self._outgoing.get((notice.lease_id, sender))
        if out is not None:
            if notice.status != "done":
                out.abort_requested = True  # the progress pass stops the write and acks
            return
        self._leases.reader_finished(notice.lease_id, sender, notice.status)

    def on_push_request(self, sender: str, request: PushRequest) -> None:
        peer = self._peers.get(sender)
        if peer is None:
            return  # not handshaken: we could not even answer
        key = (request.lease_id, sender)
        lease = self._leases.get(request.lease_id)
        if key in self._outgoing:
            return  # duplicate of a write in flight
        if lease is not None and sender in lease.finished_readers:
            # Already written, or the reader aborted first: an "aborted" answer is
            # ignored by a reader whose part is done and ends one that still waits.
            self._peers.notify(sender, self.name, request.lease_id, request.req_id, "aborted")
            return
        fail: Exception | None = None
        if lease is None:
            fail = LeaseExpiredError(f"no lease {request.lease_id} (expired or released)")
        elif not peer.write_segments:
            fail = LayoutMismatchError(f"{sender} holds none of this rank's kv heads")
        elif request.block_indices:
            # A latent cache's round-robin share: these blocks of the lease, in this order.
            if not all(0 <= i < len(lease.block_ids) for i in request.block_indices):
                fail = KVTransferError(
                    f"block indices {request.block_indices} outside the lease's "
                    f"{len(lease.block_ids)} blocks"
                )
        elif request.first_block + len(request.block_ids) > len(lease.block_ids):
            # A partial receive reads the lease's blocks from first_block on (a peer pull
            # only a prefix of them): never past the lease's end.
            n, m = len(request.block_ids), len(lease.block_ids) - request.first_block
            fail = KVTransferError(f"{n} destination blocks for {m} source blocks")
        if fail is None:
            done = CompletionNotice(self.name, request.lease_id, request.req_id, "done")
            end = request.first_block + len(request.block_ids)
            source = lease.block_ids[request.first_block : end]
            if request.block_indices:
                source = [lease.block_ids[i] for i in request.block_indices]
            try:
                xfer = self._backend.post(sender, "WRITE", source, request.block_ids, encode(done))
            except KVTransferError as exc:
                fail = exc
        if fail is not None:
            if lease is not None:
                self._leases.reader_finished(request.lease_id, sender, "failed")
            self._peers.notify(sender, self.name, request.lease_id, request.req_id, "failed", fail)
            return
        self._leases.write_started(request.lease_id)
        deadline = self._clock() + request.timeout_s * PUSH_WRITE_FRACTION
        self._outgoing[key] = Outgoing(request.lease_id, request.req_id, sender, xfer, deadline)

    def _peer_lost(self, name: str, error: PeerLostError) -> None:
        for lease_id, reader in list(self._outgoing):
            if reader == name:
                out = self._outgoing.pop((lease_id, reader))
                self._backend.cancel(out.xfer)
                self._leases.write_ended(lease_id, reader, "failed")

    def progress(self, now: float) -> None:
        for out in list(self._outgoing.values()):
            self._progress_one(out, now)
        self._leases.expire()

    def _progress_one(self, out: Outgoing, now: float) -> None:
        status, error = None, None
        try:
            if out.abort_requested or now >= out.deadline:
                if self._backend.cancel(out.xfer):
                    status = "aborted" if out.abort_requested else "failed"
                    if not out.abort_requested:
                        error = TransferTimeoutError("push write timed out")
                elif now >= out.deadline:
                    self._peers.drop(out.reader, "push write could not be stopped")
                    return
            elif self._backend.check(out.xfer):
                status = "done"
        except PeerLostError as exc:
            self._peers.drop(out.reader, str(exc))
            return
        except KVTransferError as exc:
            status, error = "failed", exc
        if status is None:
            return
        del self._outgoing[(out.lease_id, out.reader)]
        self._leases.write_ended(out.lease_id, out.reader, status)
        if status != "done":  # "done" rode on the WRITE
            self._peers.notify(out.reader, self.name, out.lease_id, out.req_id, status, error)
