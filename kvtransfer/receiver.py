"""Decode side: receives in progress (connector thread only).

A receive is one request's KV arriving into blocks the decode worker allocated: one
*part* per prefill rank that holds some of our heads. Pull posts one READ per part (its
"done" notice rides on the READ); push sends one PushRequest per part and waits for the
writer's notice. The receive's future completes only when no part can write
into our blocks any more (done, cancelled, acknowledged, or past the deadline that
bounds the writer's own), so the worker may free or reuse the blocks right after.

A latent cache (MLA) is whole on every prefill rank, so each part carries only a
round-robin share of the blocks (``tp_mapping.latent_block_sources``): each block is read
once. Every prefill rank's lease counts us as a reader, so one whose share is empty is
told "skipped" when the receive starts, and frees its blocks then rather than at expiry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtransfer.backend import TransferResult
from kvtransfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerLostError,
    TransferAbortedError,
    TransferTimeoutError,
    error_from_code,
)
from kvtransfer.layout import KVLayout
from kvtransfer.messages import CompletionNotice, KVHandle, PushRequest, encode
from kvtransfer.peers import PeerTable
from kvtransfer.tp_mapping import count_merged_descriptors, latent_block_sources


@dataclass
class Part:
    """The piece of a receive that comes from one prefill rank."""

    handle: KVHandle
    peer: str
    positions: tuple[int, ...] | None = None  # indices into handle.block_ids; None: all
    state: str = "new"  # new | posted | done | cancelled | failed | lost
    xfer: object | None = None  # pull: the READ in flight

    @property
    def is_outstanding(self) -> bool:
        """Something may still be written into our blocks for this part."""
        return self.state in ("new", "posted")


@dataclass
class Incoming:
    req_id: str
    direction: str
    future: Future
    deadline: float  # connector clock
    started: float  # perf_counter, for the result's seconds
    parts: list[Part] = field(default_factory=list)
    num_bytes: int = 0
    num_descriptors: int = 0
    error: KVTransferError | None = None  # set once failing: finish when nothing is outstanding
    abort_sent: bool = False  # push: writers were asked to stop


class Receiver:
    def __init__(
        self, peers: PeerTable, layout: KVLayout, direction: str, clock: Callable[[], float]
    ):
        self._peers = peers
        self._backend = peers.backend
        self._layout = layout
        self._direction = direction
        self._clock = clock
        self._incoming: dict[str, Incoming] = {}
        self._parts: dict[tuple[str, int], tuple[Incoming, Part]] = {}  # (owner, lease_id)
        peers.on_drop(self._peer_lost)

    def __len__(self) -> int:
        return len(self._incoming)

    # ---- commands -----------------------------------------------------------------------
    def start(self, handles: Sequence[KVHandle], block_ids, timeout: float, future: Future):
        try:
            inc = self._plan(handles, block_ids, timeout, future)
        except Exception as exc:
            # Nothing was started: every owner still learns it can free its blocks.
            status = "skipped" if isinstance(exc, LeaseExpiredError) else "failed"
            self.decline(handles, status)
            future.set_exception(exc)
            return
        self._incoming[inc.req_id] = inc
        for part in inc.parts:
            self._parts[(part.peer, part.handle.lease_id)] = (inc, part)
            self._start_part(inc, part, block_ids, timeout)

    def decline(self, handles: Sequence[KVHandle], status: str) -> None:
        for h in handles:
            self._peers.notify(h.agent_name, h.agent_name, h.lease_id, h.req_id, status)

    def abort(self, req_id: str) -> None:
        inc = self._incoming.get(req_id)
        if inc is not None and inc.error is None:
            inc.error = TransferAbortedError(f"request {req_id!r} aborted")

    def shutdown(self) -> None:
        for inc in list(self._incoming.values()):
            self._finish(inc, PeerLostError("connector closed"))

    # ---- starting ---------------------------------------------------------------------
    def _plan(self, handles, block_ids, timeout: float, future: Future) -> Incoming:
        if not handles:
            raise ValueError("receive needs at least one handle")
        req_id = handles[0].req_id
        if req_id in self._incoming:
            raise ValueError(f"request {req_id!r} is already being received")
        for block_id in block_ids:
            self._layout.block_addr(block_id)
        now = self._clock()
        inc = Incoming(req_id, self._direction, future, now + timeout, time.perf_counter())
        for handle in handles:
            peer = self._peers.get(handle.agent_name)
            if handle.req_id != req_id:
                raise ValueError("all handles of a receive must be for one request")
            if handle.fingerprint != self._layout.fingerprint:
                raise LayoutMismatchError(
                    f"handle fingerprint {handle.fingerprint} != ours {self._layout.fingerprint}"
                )
            if peer is None:
                raise PeerLostError(f"no handshake with {handle.agent_name} (or it died)")
            if not peer.read_segments:
                continue  # this prefill rank holds none of our heads
            if len(handle.block_ids) != len(block_ids):
                raise ValueError(
                    f"{len(handle.block_ids)} source blocks but {len(block_ids)} destination blocks"
                )
            # A pull must never read blocks whose lease may have ended (the owner may
            # have freed them): refuse a handle whose lease ends before our deadline.
            if time.time() - handle.issued_unix + timeout > handle.lease_seconds:
                raise LeaseExpiredError(
                    f"lease of {req_id!r} on {handle.agent_name} ends before the deadline"
                )
            inc.parts.append(Part(handle, handle.agent_name))
        if not inc.parts:
            raise ValueError("no handle holds any of this rank's kv heads")
        if self._layout.is_latent:
            self._share_latent_blocks(inc, len(block_ids))
        return inc

    def _share_latent_blocks(self, inc: Incoming, num_blocks: int) -> None:
        """Give each part its round-robin share of the blocks, per prefill stage; tell a
        prefill rank with no share that we read nothing from it (its lease counts us)."""
        stages: dict[tuple[int, int], list[Part]] = {}
        for part in inc.parts:
            stages.setdefault(self._peers.get(part.peer).meta.layout.layer_range, []).append(part)
        kept = []
        for parts in stages.values():
            by_rank = {self._peers.get(p.peer).meta.layout.tp_rank: p for p in parts}
            first_block = parts[0].handle.first_block
            shares = latent_block_sources(
                first_block, num_blocks, list(by_rank), self._layout.tp_rank
            )
            for rank, positions in shares.items():
                part = by_rank[rank]
                if positions:
                    part.positions = positions
                    kept.append(part)
                else:
                    self.decline([part.handle], "skipped")
        inc.parts = kept

    def _start_part(self, inc: Incoming, part: Part, block_ids, timeout: float) -> None:
        handle, peer = part.handle, self._peers.get(part.peer)
        src_ids, dst_ids, lease_indices = handle.block_ids, tuple(block_ids), ()
        if part.positions is not None:  # a latent share (_share_latent_blocks)
            src_ids = tuple(handle.block_ids[i] for i in part.positions)
            dst_ids = tuple(dst_ids[i] for i in part.positions)
            lease_indices = tuple(handle.first_block + i for i in part.positions)
        inc.num_bytes += len(dst_ids) * sum(s.length for s in peer.read_segments)
        inc.num_descriptors += count_merged_descriptors(
            src_ids, dst_ids, peer.read_segments,
            peer.meta.layout.block_stride, self._layout.block_stride,
        )  # fmt: skip
        try:
            if inc.direction == "pull":
                done = CompletionNotice(handle.agent_name, handle.lease_id, inc.req_id, "done")
                part.xfer = self._backend.post(part.peer, "READ", dst_ids, src_ids, encode(done))
            else:
                request = PushRequest(
                    handle.lease_id, inc.req_id, dst_ids, timeout, handle.first_block,
                    lease_indices,
                )  # fmt: skip
                self._backend.send_notif(part.peer, encode(request))
            part.state = "posted"
        except PeerLostError as exc:
            part.state = "lost"
            inc.error = inc.error or exc
            self._peers.drop(part.peer, str(exc))
        except KVTransferError as exc:
            part.state = "failed"
            inc.error = inc.error or exc

    # ---- events -------------------------------------------------------------------------
    def on_notice(self, sender: str, notice: CompletionNotice) -> None:
        """The writer (push) says our part is done, failed or aborted."""
        entry = self._parts.get((notice.owner, notice.lease_id))
        if entry is None or sender != notice.owner:
            return  # late, duplicate or foreign: harmless
        inc, part = entry
        if not part.is_outstanding:
            return
        if notice.status == "done":
            part.state = "done"
            return
        part.state = "failed"
        error = error_from_code(notice.error_code, notice.message or notice.status)
        if notice.status == "aborted":
            error = TransferAbortedError(f"{sender} aborted the transfer of {inc.req_id!r}")
        inc.error = inc.error or error

    def _peer_lost(self, name: str, error: PeerLostError) -> None:
        for inc in self._incoming.values():
            for part in inc.parts:
                if part.peer == name and part.is_outstanding:
                    if part.xfer is not None:
                        self._backend.cancel(part.xfer)
                    part.state = "lost"
                    inc.error = inc.error or error

    def progress(self, now: float) -> None:
        for inc in list(self._incoming.values()):
            self._progress_one(inc, now)

    def _progress_one(self, inc: Incoming, now: float) -> None:
        for part in inc.parts:
            if part.state != "posted" or part.xfer is None:
                continue
            try:
                if inc.error is not None and self._backend.cancel(part.xfer):
                    part.state = "cancelled"
                elif self._backend.check(part.xfer):
                    part.state = "done"
            except PeerLostError as exc:
                part.state = "lost"
                inc.error = inc.error or exc
                self._peers.drop(part.peer, str(exc))
            except KVTransferError as exc:
                part.state = "failed"
                inc.error = inc.error or exc
        if inc.error is None and all(p.state == "done" for p in inc.parts):
            self._finish(inc, None)
            return
        if now >= inc.deadline and inc.error is None:
            inc.error = TransferTimeoutError(f"KV of {inc.req_id!r} not received in time")
        if inc.error is None:
            return
        outstanding = [p for p in inc.parts if p.is_outstanding]
        if outstanding and now < inc.deadline:
            if inc.direction == "push" and not inc.abort_sent:
                for part in outstanding:  # ask the writers to stop; they acknowledge
                    self._peers.notify(
                        part.peer, part.peer, part.handle.lease_id, inc.req_id, "aborted"
                    )
                inc.abort_sent = True
            return
        for part in outstanding:
            if part.xfer is not None and not self._backend.cancel(part.xfer):
                # A READ that can neither finish nor stop by the deadline: the peer is
                # hung. Dropping it closes the endpoint, so nothing lands in our blocks.
                self._peers.drop(part.peer, "transfer could not be stopped")
        # Push parts still outstanding here are past our deadline, hence past the
        # writer's (half of ours): no write can land any more.
        self._finish(inc, inc.error)

    def _finish(self, inc: Incoming, error: KVTransferError | None) -> None:
        self._incoming.pop(inc.req_id, None)
        for part in inc.parts:
            self._parts.pop((part.peer, part.handle.lease_id), None)
            if error is not None and part.state != "done" and not inc.abort_sent:
                # Pull: "done" rode on the READ; anything else must still free the owner.
                status = "aborted" if isinstance(error, TransferAbortedError) else "failed"
                self._peers.notify(
                    part.peer, part.peer, part.handle.lease_id, inc.req_id, status, error
                )
        if inc.future.done():
            return
        if error is not None:
            inc.future.set_exception(error)
            return
        seconds = time.perf_counter() - inc.started
        inc.future.set_result(
            TransferResult(inc.req_id, inc.direction, inc.num_bytes, inc.num_descriptors, seconds)
        )
