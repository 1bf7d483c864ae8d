"""In-process backend: the same interface as NIXL, for unit tests of the code around it.

Agents attach to a :class:`LocalFabric` (a stand-in for the network) by name; a
transfer copies the segment byte ranges between the two caches' tensors, and a
notification is appended to the peer's inbox. With ``hold_transfers`` the fabric
keeps posted transfers pending until ``complete_held()``, so that tests can abort or
kill a peer *during* a transfer; ``kill(name)`` makes an agent unreachable, as a
crashed process would be. ``bandwidth`` (bytes/s) and ``per_transfer_s`` make a posted
transfer take ``per_transfer_s + bytes / bandwidth`` on the poster's thread, one after
the other as on one link: a deterministic stand-in for a network in timeline tests and
benches (``bench/layerwise.py``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.errors import PeerLostError, TransferFailedError
from kvtransfer.layout import KVLayout
from kvtransfer.tp_mapping import Segment, segments_for_layers


class LocalFabric:
    def __init__(
        self,
        hold_transfers: bool = False,
        *,
        bandwidth: float | None = None,
        per_transfer_s: float = 0.0,
    ):
        self.hold_transfers = hold_transfers
        self.bandwidth = bandwidth  # bytes per second; None: as fast as the copy
        self.per_transfer_s = per_transfer_s
        self._agents: dict[str, LocalBackend] = {}
        self._dead: set[str] = set()
        self._held: list[_Xfer] = []
        self._lock = threading.Lock()

    def attach(self, backend: LocalBackend) -> None:
        with self._lock:
            self._agents[backend.name] = backend

    def get(self, name: str) -> LocalBackend:
        with self._lock:
            agent = self._agents.get(name)
        if agent is None or name in self._dead:
            raise PeerLostError(f"agent {name} is unreachable")
        return agent

    def kill(self, name: str) -> None:
        """The agent's process 'crashes': it is unreachable and its transfers fail."""
        with self._lock:
            self._dead.add(name)

    def hold(self, xfer: _Xfer) -> None:
        with self._lock:
            self._held.append(xfer)

    def complete_held(self) -> int:
        """Run the held transfers that are still wanted; returns how many ran."""
        with self._lock:
            held, self._held = self._held, []
        count = 0
        for xfer in held:
            if xfer.state == "pending":
                xfer.run(self)
                count += 1
        return count


@dataclass
class _Xfer:
    initiator: LocalBackend
    peer: str
    op: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    notif: bytes
    state: str = "pending"  # pending | done | cancelled | failed

    def run(self, fabric: LocalFabric) -> None:
        try:
            remote = fabric.get(self.peer)
            fabric.get(self.initiator.name)
        except PeerLostError:
            self.state = "failed"
            return
        # Segment offsets are (data source, data destination): READ moves remote -> local.
        local, local_ids = self.initiator, self.local_block_ids
        if self.op == "READ":
            src, src_ids, dst, dst_ids = remote, self.remote_block_ids, local, local_ids
        else:
            src, src_ids, dst, dst_ids = local, local_ids, remote, self.remote_block_ids
        pairs = [(s.src_offset, s.dst_offset, s.length) for s in self.segments]
        if fabric.bandwidth is not None or fabric.per_transfer_s:
            num_bytes = len(src_ids) * sum(length for _, _, length in pairs)
            time.sleep(fabric.per_transfer_s + num_bytes / (fabric.bandwidth or float("inf")))
        src_stride, dst_stride = src.layout.block_stride, dst.layout.block_stride
        for src_block, dst_block in zip(src_ids, dst_ids, strict=True):
            for src_offset, dst_offset, length in pairs:
                s = src_block * src_stride + src_offset
                d = dst_block * dst_stride + dst_offset
                dst.memory[d : d + length].copy_(src.memory[s : s + length])
        self.state = "done"
        if self.notif:  # as NIXL: an empty message sends no notification
            remote.deliver(self.initiator.name, self.notif)


class LocalBackend:
    preferred_direction = "pull"

    def __init__(self, name: str, kv_cache: torch.Tensor, layout: KVLayout, fabric: LocalFabric):
        self.name = name
        self.layout = layout
        self.fabric = fabric
        base = kv_cache.reshape(-1).view(torch.uint8)
        if kv_cache.data_ptr() != layout.base_addr or base.numel() < layout.num_bytes:
            raise ValueError("kv_cache tensor does not match its layout")
        self.memory = base
        self._inbox: deque[tuple[str, bytes]] = deque()
        # peer -> (read segments, write segments, the peer's layout)
        self._plans: dict[str, tuple[tuple[Segment, ...], tuple[Segment, ...], KVLayout]] = {}

    def open(self) -> bytes:
        self.fabric.attach(self)
        return f"local:{self.name}".encode()

    def connect(self, peer, agent_metadata, remote, read_segments, write_segments) -> None:
        if agent_metadata != f"local:{peer}".encode():
            raise PeerLostError(f"bad agent metadata for {peer}")
        self.fabric.get(peer)
        self._plans[peer] = (tuple(read_segments), tuple(write_segments), remote)

    def disconnect(self, peer: str) -> None:
        self._plans.pop(peer, None)

    def post(
        self,
        peer: str,
        op: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        layers: tuple[int, int] | None = None,
    ) -> _Xfer:
        if peer not in self._plans:
            raise PeerLostError(f"not connected to {peer}")
        self.fabric.get(peer)
        read_segments, write_segments, remote = self._plans[peer]
        segments = read_segments if op == "READ" else write_segments
        if layers is not None:  # the data's source: the peer for a READ, we for a WRITE
            segments = segments_for_layers(
                segments, remote if op == "READ" else self.layout, layers
            )
        xfer = _Xfer(
            self, peer, op, tuple(local_block_ids), tuple(remote_block_ids), segments, notif
        )
        if self.fabric.hold_transfers:
            self.fabric.hold(xfer)
        else:
            xfer.run(self.fabric)
        return xfer

    def check(self, xfer: _Xfer) -> bool:
        if xfer.state == "failed":
            raise PeerLostError(f"transfer with {xfer.peer} failed: peer unreachable")
        if xfer.state == "cancelled":
            raise TransferFailedError("transfer was cancelled")
        return xfer.state == "done"

    def cancel(self, xfer: _Xfer) -> bool:
        if xfer.state == "pending":
            xfer.state = "cancelled"
        return True

    def send_notif(self, peer: str, data: bytes) -> None:
        self.fabric.get(peer).deliver(self.name, data)

    def deliver(self, sender: str, data: bytes) -> None:
        self._inbox.append((sender, data))  # deque.append is atomic

    def get_notifs(self) -> list[tuple[str, bytes]]:
        notifs = []
        while self._inbox:
            notifs.append(self._inbox.popleft())
        return notifs

    def close(self) -> None:
        self.fabric.kill(self.name)
