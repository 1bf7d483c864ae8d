"""NIXL backend (UCX): RDMA / NVLink on GPU clusters, shared memory (cma) or TCP on one host.

Built on NIXL's own bindings (``nixl._bindings``, the layer under ``nixl._api``):

- the wrapper ``nixl_agent`` hard-codes the progress thread's delay to 0 (nixl 1.5.1:
  ``agent_config.pthrDelay = 0``), so an idle agent busy-spins a core; we build the
  ``nixlAgentConfig`` ourselves with ``progress_delay_us`` (100 µs: the thread blocks in
  ``poll()``; measured 0.95 core idle with 0, 0.02 with 100, see docs/kvtransfer.md);
- the wrapper's ``get_serialized_descs`` is pickle; metadata here travels as the raw
  agent metadata bytes inside our msgpack handshake.

One agent per worker rank, named ``<worker_id>#<incarnation>``. The whole cache is
registered once (one region), the local descriptor list is prepared once per
segment plan and the remote one once per peer, and each transfer is one
``makeXferReq`` over (block, segment) indices, so NIXL merges runs of consecutive
blocks into single descriptors. Every method runs on the connector's thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtransfer.backend import KVTransferConfig
from kvtransfer.errors import KVTransferError, PeerLostError, TransferFailedError
from kvtransfer.layout import KVLayout
from kvtransfer.tp_mapping import Segment, segments_for_layers

logger = logging.getLogger(__name__)

# Which direction is faster, measured by bench/kv_handoff.py between two processes on
# one host (docs/kvtransfer.md): over shared memory (UCX cma) a READ beats a WRITE
# (11.4 vs 7.4 GB/s, 256 MiB); over TCP a READ is emulated in software and a WRITE is
# 2.3x faster (2.26 vs 1.00 GB/s); between GPUs on one node NIXL-NOTES measured WRITE
# 2-3x faster; over RDMA both are one-sided and equal.
_SHARED_OR_RDMA_TLS = (
    "sm",
    "shm",
    "cma",
    "knem",
    "xpmem",
    "posix",
    "sysv",
    "rc",
    "ud",
    "dc",
    "ib",
    "all",
)


def preferred_direction(layout: KVLayout, ucx_tls: str | None = None) -> str:
    """The faster direction for this cache's memory and the transports UCX may use."""
    if layout.device_type == "cuda":
        return "push"
    tls = os.environ.get("UCX_TLS", "") if ucx_tls is None else ucx_tls
    names = [t.strip().lstrip("^") for t in tls.split(",") if t.strip()]
    if (
        names
        and not tls.startswith("^")
        and not any(n.startswith(_SHARED_OR_RDMA_TLS) for n in names)
    ):
        return "push"  # TCP only
    return "pull"


# NIXL exceptions (by class name, so that this module imports without nixl) that mean
# the peer is gone rather than that one transfer failed.
_PEER_LOST = {"nixlRemoteDisconnectError", "nixlNotFoundError"}


def _translate(exc: Exception, what: str) -> KVTransferError:
    name = type(exc).__name__
    if name in _PEER_LOST:
        return PeerLostError(f"{what}: {name}: {exc}")
    return TransferFailedError(f"{what}: {name}: {exc}")


@dataclass
class _Xfer:
    handle: int
    is_done: bool = False
    is_released: bool = False


class NixlBackend:
    def __init__(self, name: str, kv_cache, layout: KVLayout, config: KVTransferConfig):
        if kv_cache is not None and kv_cache.data_ptr() != layout.base_addr:
            raise ValueError("kv_cache tensor does not match its layout")
        self.name = name
        self.preferred_direction = preferred_direction(layout)
        self.layout = layout
        self._kv_cache = kv_cache  # keeps the registered memory alive
        self._config = config
        self._nixl = None
        self._agent = None
        self._reg_descs = None
        # (local offsets, lengths) -> prepared local list handle, shared by peers
        self._local_dlists: dict[tuple, int] = {}
        # (peer, op) or (peer, op, layers) -> (local handle, remote handle, segments per
        # block); a layer group's lists are prepared on its first use
        self._dlists: dict[tuple, tuple[int, int, int]] = {}
        self._plans: dict[tuple[str, str], tuple[tuple[Segment, ...], KVLayout]] = {}
        self._remote_handles: dict[str, list[int]] = {}
        self._notif_map: dict = {}

    # ---- set-up -------------------------------------------------------------------------
    def open(self) -> bytes:
        import nixl._bindings as nixl

        self._nixl = nixl
        agent_config = nixl.nixlAgentConfig()
        # The progress thread lets the passive side make progress without polling; the
        # delay makes it sleep in poll() between events instead of spinning.
        agent_config.useProgThread = True
        agent_config.pthrDelay = self._config.progress_delay_us
        # No listener thread: metadata travels over our control plane, as msgpack.
        agent_config.useListenThread = False
        # Every call comes from the connector thread: no locking needed inside NIXL.
        agent_config.syncMode = nixl.NIXL_THREAD_SYNC_NONE
        self._agent = nixl.nixlAgent(self.name, agent_config)
        if "UCX" not in self._agent.getAvailPlugins():
            raise TransferFailedError("NIXL has no UCX plugin")
        self._agent.createBackend("UCX", {})
        mem = self._mem_type(self.layout)
        self._reg_descs = nixl.nixlRegDList(
            mem, [(self.layout.base_addr, self.layout.num_bytes, self.layout.device_id, "")]
        )
        try:
            self._agent.registerMem(self._reg_descs, [])
        except Exception as exc:
            raise _translate(exc, "registering the KV cache") from exc
        return bytes(self._agent.getLocalMD())

    def _mem_type(self, layout: KVLayout):
        return self._nixl.VRAM_SEG if layout.device_type == "cuda" else self._nixl.DRAM_SEG

    def _dlist(self, layout: KVLayout, offsets: Sequence[int], lengths: Sequence[int]):
        """Descriptors of every (block, segment) of ``layout``, block-major."""
        blocks = np.arange(layout.num_blocks, dtype=np.uint64)[:, None]
        addrs = layout.base_addr + blocks * layout.block_stride + np.asarray(offsets, np.uint64)
        descs = np.empty((addrs.size, 3), dtype=np.uint64)
        descs[:, 0] = addrs.reshape(-1)
        descs[:, 1] = np.tile(np.asarray(lengths, np.uint64), layout.num_blocks)
        descs[:, 2] = layout.device_id
        return self._nixl.nixlXferDList(self._mem_type(layout), descs)

    def connect(
        self,
        peer: str,
        agent_metadata: bytes,
        remote: KVLayout,
        read_segments: Sequence[Segment],
        write_segments: Sequence[Segment],
    ) -> None:
        try:
            loaded = self._agent.loadRemoteMD(agent_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != peer:
                raise PeerLostError(f"metadata names agent {loaded!r}, expected {peer!r}")
            for op, segments in (("READ", read_segments), ("WRITE", write_segments)):
                self._plans[(peer, op)] = (tuple(segments), remote)
                if segments:
                    self._prepare((peer, op), peer, op, segments, remote)
            self._agent.makeConnection(peer, [])
        except KVTransferError:
            self.disconnect(peer)
            raise
        except Exception as exc:
            self.disconnect(peer)
            raise _translate(exc, f"connecting to {peer}") from exc

    def _prepare(self, key: tuple, peer: str, op: str, segments, remote: KVLayout) -> None:
        """Prepare the (local, remote) descriptor lists of ``segments`` with ``peer``."""
        lengths = [s.length for s in segments]
        # READ: the data goes remote (src) -> local (dst); WRITE: local -> remote.
        local_off = [s.dst_offset if op == "READ" else s.src_offset for s in segments]
        remote_off = [s.src_offset if op == "READ" else s.dst_offset for s in segments]
        local_key = (tuple(local_off), tuple(lengths))
        if local_key not in self._local_dlists:
            self._local_dlists[local_key] = self._agent.prepXferDlist(
                self._nixl.NIXL_INIT_AGENT, self._dlist(self.layout, local_off, lengths), []
            )
        remote_handle = self._agent.prepXferDlist(
            peer, self._dlist(remote, remote_off, lengths), []
        )
        self._remote_handles.setdefault(peer, []).append(remote_handle)
        self._dlists[key] = (self._local_dlists[local_key], remote_handle, len(segments))

    def disconnect(self, peer: str) -> None:
        for key in [k for k in self._dlists if k[0] == peer]:
            del self._dlists[key]
        for key in [k for k in self._plans if k[0] == peer]:
            del self._plans[key]
        for handle in self._remote_handles.pop(peer, []):
            try:
                self._agent.releasedDlistH(handle)
            except Exception:
                logger.debug("releasing a descriptor list of %s failed", peer, exc_info=True)
        try:
            # NIXL accepts a peer it never loaded (connect failed early) without an error,
            # so a failure here is unexpected: the peer's metadata may stay loaded.
            self._agent.invalidateRemoteMD(peer)
        except Exception:
            logger.warning("forgetting the NIXL metadata of %s failed", peer, exc_info=True)

    # ---- transfers ----------------------------------------------------------------------
    def post(
        self,
        peer: str,
        op: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        layers: tuple[int, int] | None = None,
    ) -> _Xfer:
        key = (peer, op) if layers is None else (peer, op, tuple(layers))
        entry = self._dlists.get(key)
        if entry is None and layers is not None and (peer, op) in self._plans:
            segments, remote = self._plans[(peer, op)]
            group = segments_for_layers(segments, remote if op == "READ" else self.layout, layers)
            if group:
                try:
                    self._prepare(key, peer, op, group, remote)
                except Exception as exc:
                    raise _translate(exc, f"preparing layers {layers} with {peer}") from exc
                entry = self._dlists.get(key)
        if entry is None:
            raise PeerLostError(f"no {op} descriptor lists for {peer} (not connected)")
        local_handle, remote_handle, num_segments = entry
        segs = np.arange(num_segments, dtype=np.int32)
        local_idx = (np.asarray(local_block_ids, np.int32)[:, None] * num_segments + segs).ravel()
        remote_idx = (np.asarray(remote_block_ids, np.int32)[:, None] * num_segments + segs).ravel()
        nixl_op = self._nixl.NIXL_READ if op == "READ" else self._nixl.NIXL_WRITE
        try:
            xfer = _Xfer(
                self._agent.makeXferReq(
                    nixl_op, local_handle, local_idx, remote_handle, remote_idx, notif, []
                )
            )
        except Exception as exc:
            raise _translate(exc, f"{op} with {peer}") from exc
        try:
            # On one host (cma) this may copy synchronously before returning.
            status = self._agent.postXferReq(xfer.handle, b"")
        except Exception as exc:
            self._release(xfer)
            raise _translate(exc, f"posting {op} with {peer}") from exc
        xfer.is_done = status == self._nixl.NIXL_SUCCESS
        return xfer

    def check(self, xfer: _Xfer) -> bool:
        if not xfer.is_done:
            try:
                status = self._agent.getXferStatus(xfer.handle)
            except Exception as exc:
                self._release(xfer)
                raise _translate(exc, "transfer") from exc
            if status == self._nixl.NIXL_IN_PROG:
                return False
            if status != self._nixl.NIXL_SUCCESS:
                self._release(xfer)
                raise TransferFailedError(f"transfer ended with status {status}")
            xfer.is_done = True
        self._release(xfer)
        return True

    def cancel(self, xfer: _Xfer) -> bool:
        error = self._try_release(xfer)
        if error is not None:
            # Not a warning: the sender and receiver poll cancel() every step until the
            # transfer stops, and drop the peer (with a log line) if it never does.
            logger.debug("NIXL cannot release a transfer yet: %s: %s", type(error).__name__, error)
        return error is None

    def _release(self, xfer: _Xfer) -> None:
        error = self._try_release(xfer)
        if error is not None:
            logger.warning(
                "NIXL could not release a finished transfer: %s: %s", type(error).__name__, error
            )

    def _try_release(self, xfer: _Xfer) -> Exception | None:
        """Release ``xfer`` (aborting it if still in progress and NIXL can); None on
        success, else NIXL's exception."""
        if xfer.is_released:
            return None
        try:
            self._agent.releaseXferReq(xfer.handle)
        except Exception as exc:
            return exc
        xfer.is_released = True
        return None

    # ---- notifications ------------------------------------------------------------------
    def send_notif(self, peer: str, data: bytes) -> None:
        try:
            self._agent.genNotif(peer, data, [])
        except Exception as exc:
            raise _translate(exc, f"notifying {peer}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._notif_map.clear()
        notifs = self._agent.getNotifs(self._notif_map, [])
        return [(name, bytes(msg)) for name, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        if self._agent is None:
            return
        for peer in list(self._remote_handles):
            self.disconnect(peer)
        for handle in self._local_dlists.values():
            try:
                self._agent.releasedDlistH(handle)
            except Exception:
                logger.warning("releasing a local NIXL descriptor list failed", exc_info=True)
        self._local_dlists.clear()
        try:
            self._agent.deregisterMem(self._reg_descs, [])
        except Exception:
            logger.debug("deregistering the KV cache failed", exc_info=True)
        self._agent = None  # the C++ agent stops its threads when destroyed
