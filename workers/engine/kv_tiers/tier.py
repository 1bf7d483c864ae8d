"""What every KV tier below the engine's pool (G1) offers: the contract between the tiers
(``host_tier.py`` G2, ``disk_tier.py`` G3, ``peer_tier.py`` G4) and the code that moves
blocks between them (``manager.py``).

A tier holds whole blocks: one block is the bytes of ``kv_cache[block_id]`` (every layer,
K and V, block-major; docs/kv-cache-layout.md), ``block_bytes`` long, keyed by the
block's chained prefix hash (``workers/protocol/block_hashes.py``). A tier is built for
one :class:`~workers.engine.kv_tiers.keys.CacheFingerprint` (model, dtype, layout, block
size) and never returns a block written under another: the hash alone says which tokens,
the fingerprint says whose KV.

Blocks are immutable once stored (a full, committed block's KV never changes), so a tier
never updates a block in place: ``put`` of a hash it already holds only refreshes its
recency. Every method is safe to call from several threads (the engine loop onboards, the
offload thread writes down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TierStats:
    """A tier's counters since it was built (monotonic, except ``blocks``/``bytes``)."""

    name: str  # "host" | "disk" | "peer"
    blocks: int = 0  # blocks held now
    bytes: int = 0  # bytes held now (blocks * block_bytes, plus any per-block header)
    capacity_blocks: int = 0
    hits: int = 0  # get() that returned a block
    misses: int = 0  # get() that did not (absent, or unreadable: see ``errors``)
    errors: int = 0  # blocks found unusable (bad checksum, truncated, I/O error): misses
    onboard_bytes: int = 0  # bytes read out by get()
    onboard_seconds: float = 0.0
    offload_bytes: int = 0  # bytes written in by put()
    offload_seconds: float = 0.0
    evictions: int = 0  # blocks dropped to make room
    rejected: int = 0  # put() refused (full disk, tier disabled after an error, ...)


@dataclass(frozen=True)
class TierEvents:
    """Hashes a tier started / stopped holding since the previous ``drain_events``
    (what a worker publishes: Dynamo-style stored / removed KV events)."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


class KVTier(Protocol):
    name: str
    block_bytes: int

    def contains(self, block_hash: int) -> bool:
        """Whether ``get`` would probably find the block (a disk file may still fail its
        checksum then: that ``get`` is a miss)."""

    def get(self, block_hash: int, out: torch.Tensor) -> bool:
        """Copy the block into ``out`` (a contiguous uint8 tensor of ``block_bytes``).

        False, with ``out`` in an unspecified state, on a miss of any kind (absent,
        corrupt, truncated, unreadable): never raises for a bad block, never returns
        wrong bytes. A hit refreshes the block's recency."""

    def put(self, block_hash: int, data: torch.Tensor) -> bool:
        """Store a copy of ``data`` (a contiguous uint8 tensor of ``block_bytes``), evicting
        the least recently used blocks if the tier is full. False when it was not stored
        (no room that can be made, a full disk, an I/O error): offload stops, serving
        goes on. ``data`` may be reused by the caller as soon as this returns."""

    def hashes(self) -> frozenset[int]:
        """Every hash the tier holds now."""

    def drain_events(self) -> TierEvents:
        """Stored / removed hashes since the last call (the first call: since built)."""

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Release memory / file handles; the disk tier's files stay for the next start."""
