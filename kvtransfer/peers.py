"""Handshaken peers, dead incarnations and completion notices (connector thread only)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.backend import KVBackend
from kvtransfer.errors import KVTransferError, PeerLostError
from kvtransfer.layout import KVLayout, check_compatible
from kvtransfer.messages import CompletionNotice, HandshakeMetadata, encode
from kvtransfer.tp_mapping import Segment, replica_segments

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    """A handshaken peer and what a whole-request transfer moves with it, per block.

    For K/V caches the stream segments are the same as the whole-request ones. For a latent
    cache (MLA) every pair holding common layers moves whole rows, in both hand-offs: a
    request's blocks are spread round robin over the stage's prefill ranks
    (:func:`~kvtransfer.tp_mapping.latent_block_sources`; a stream's writes likewise,
    ``stream.py``), so every such prefill rank is a source of every decode rank.
    """

    meta: HandshakeMetadata
    read_segments: tuple[Segment, ...]  # the peer is the source, we read (or it pushes to us)
    write_segments: tuple[Segment, ...]  # we are the source, the peer the destination
    stream_read_segments: tuple[Segment, ...] = ()
    stream_write_segments: tuple[Segment, ...] = ()


class PeerTable:
    """Who we can talk to. A dropped peer's agent name (its incarnation) stays refused."""

    def __init__(self, backend: KVBackend, layout: KVLayout):
        self.backend = backend
        self.layout = layout
        self._peers: dict[str, Peer] = {}
        self._peer_of_worker: dict[str, str] = {}
        self._dead: set[str] = set()
        self._on_drop: list[Callable[[str, PeerLostError], None]] = []

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def replica_agents(self, worker_id: str) -> tuple[str, ...]:
        """The live agents of every rank of replica ``worker_id``: its rank 0 (the worker's
        name) and its other ranks (``<name>.rank<k>``, ``WorkerSpec.rank_name``). Raises
        KVTransferError unless they are all handshaken: each layer of the model held by
        ``tp_size`` distinct ranks (a stream missing a rank would end "done" without that
        rank's heads)."""
        ranks = [
            (name, peer.meta.layout)
            for name, peer in self._peers.items()
            if _is_rank_of(peer.meta.worker_id, worker_id)
        ]
        if not ranks:
            raise KVTransferError(f"no KV handshake with {worker_id}")
        total = ranks[0][1].total_num_layers
        holders: dict[int, set[int]] = {layer: set() for layer in range(total)}
        for _name, layout in ranks:
            for layer in range(*layout.layer_range):
                holders[layer].add(layout.tp_rank)
        tp_size = ranks[0][1].tp_size
        missing = [layer for layer, held in holders.items() if len(held) != tp_size]
        if missing or any(layout.tp_size != tp_size for _n, layout in ranks):
            raise KVTransferError(
                f"{worker_id}: {len(ranks)} ranks handshaken, not all of its replica "
                f"(layers {missing[:4]} lack a TP rank)"
            )
        return tuple(sorted(name for name, _layout in ranks))

    def on_drop(self, callback: Callable[[str, PeerLostError], None]) -> None:
        """``callback(name, error)`` runs when a peer is dropped, before it is unloaded."""
        self._on_drop.append(callback)

    def add(self, meta: HandshakeMetadata) -> str:
        name = meta.agent_name
        if name in self._dead:
            raise PeerLostError(f"peer {name} is a dead incarnation; handshake with a new one")
        if name in self._peers:
            return name
        check_compatible(self.layout, meta.layout)
        old = self._peer_of_worker.get(meta.worker_id)
        if old is not None and old != name:
            self.drop(old, f"replaced by incarnation {meta.incarnation}")
        read_segments = replica_segments(meta.layout, self.layout)
        write_segments = replica_segments(self.layout, meta.layout)
        self.backend.connect(name, meta.agent_metadata, meta.layout, read_segments, write_segments)
        self._peers[name] = Peer(
            meta,
            read_segments,
            write_segments,
            stream_read_segments=read_segments,
            stream_write_segments=write_segments,
        )
        self._peer_of_worker[meta.worker_id] = name
        return name

    def drop(self, name: str, reason: str) -> None:
        """Forget a peer for good: its transfers fail with PeerLostError."""
        peer = self._peers.pop(name, None)
        self._dead.add(name)
        if peer is not None and self._peer_of_worker.get(peer.meta.worker_id) == name:
            del self._peer_of_worker[peer.meta.worker_id]
        error = PeerLostError(f"peer {name} lost: {reason}")
        for callback in self._on_drop:
            callback(name, error)
        # Last: unloading the peer closes its endpoints, so nothing of ours is still read
        # or written through them.
        self.backend.disconnect(name)

    def notify(
        self,
        peer: str,
        owner: str,
        lease_id: int,
        req_id: str,
        status: str,
        error: Exception | None = None,
    ) -> None:
        """Send a CompletionNotice; a lost one is harmless (leases expire)."""
        if peer not in self._peers:
            return  # a dead or unknown peer has nothing to free
        code = getattr(error, "code", "") if error is not None else ""
        notice = CompletionNotice(owner, lease_id, req_id, status, code, str(error or ""))
        try:
            self.backend.send_notif(peer, encode(notice))
        except PeerLostError as exc:
            self.drop(peer, str(exc))
        except KVTransferError:
            logger.warning("notice to %s for %s lost", peer, req_id, exc_info=True)


def _is_rank_of(worker_id: str, replica: str) -> bool:
    """``worker_id`` names rank 0 of ``replica`` (its name) or another of its ranks."""
    rest = worker_id.removeprefix(replica)
    return worker_id == replica or (
        rest != worker_id and rest.startswith(".rank") and rest[5:].isdigit()
    )
