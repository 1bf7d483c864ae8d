"""Moves KV blocks between the engine's pool (G1) and the tiers below it (G2 host, G3 disk).

``LLMEngine.kv_tiers`` is one of these (None when no tier is configured). The engine thread
calls it at two moments (docs/kv-tiers.md has the why of each):

- **Offload, when the pool evicts a block** (``BlockManager.on_evict``, during scheduling):
  the block's bytes are copied into the host tier right there, synchronously: one memcpy of
  a block that is about to be handed out and overwritten, so no later write (the step's,
  or an onboarding into the same block id) can race it. The disk gets the block later,
  from the host tier, on the writer's thread (``write_behind.py``); without a host tier a
  small internal one stages blocks for it. A slow or failing disk drops offloads (counted),
  never a step.
- **Onboard, on admission** (``Scheduler``'s admission path): after the pool's own prefix
  lookup, ``find`` continues the chain of block hashes through the tiers; once the request
  has its blocks, ``onboard`` copies the hits into them, in order, and stops at the first
  block a tier fails to deliver (a miss: the request computes from there). Or, for the hits
  ``layerwise.applies`` to, ``start_onboard`` copies them layer group by layer group on a
  thread while the request's first chunk computes (``layer_onboard.py``).

And once at shutdown, when nothing runs the engine any more: ``close`` writes down to the
disk what it lacks (the pool's committed blocks, the writer's pending ones) within a time
limit (``flush.py``), then unlocks the disk's directory (``dir_lock.py``).

Single-rank only (the block a TP rank or a pipeline stage holds is a slice of the model's
KV: ``build.py`` refuses those replicas).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workers.engine.kv_tiers.dir_lock import DirLock
from workers.engine.kv_tiers.flush import FLUSH_S, FlushStats, Reader, flush
from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.layer_onboard import LayerOnboarder, OnboardMode
from workers.engine.kv_tiers.tier import KVTier
from workers.engine.kv_tiers.write_behind import WriteBehind, WriteBehindStats
from workers.protocol.block_hashes import NONE_HASH, hash_block_tokens

if TYPE_CHECKING:
    from workers.engine.block_manager import BlockManager, PrefixHit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierHit:
    """Blocks after the pool's prefix hit that the tiers hold, in chain order."""

    block_hashes: tuple[int, ...] = ()
    tier_indexes: tuple[int, ...] = ()  # per block: which of the lookup tiers holds it

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(frozen=True)
class TierManagerStats:
    """What crossed the pool's boundary since start (blocks)."""

    offloaded: int = 0  # pool evictions stored in the first tier below
    offload_failed: int = 0  # ... that it refused or that raised
    onboarded: int = 0  # blocks copied into the pool instead of computed
    onboard_failed: int = 0  # found by ``find`` but unreadable by ``onboard``: computed
    writer: WriteBehindStats = field(default_factory=WriteBehindStats)
    flush: FlushStats = field(default_factory=FlushStats)  # the write-down at close


class KVTierManager:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_manager: BlockManager,
        host: HostTier | None,
        disk: KVTier | None = None,
        staging: HostTier | None = None,
        inline_writes: bool = False,
        disk_lock: DirLock | None = None,
        onboard_mode: OnboardMode = "off",
    ) -> None:
        """``host``: G2 or None; ``disk``: G3 or None. ``staging``: with a disk and no host
        tier, the internal host-memory buffer the disk writer reads behind (not a tier
        reported in ``tiers``, though lookups use it: what it holds is valid KV).
        ``inline_writes``: write to the disk inside ``offload``, without the writer's
        thread (tests whose schedules must not depend on a thread's timing).
        ``disk_lock``: the disk tier's directory lock, released by ``close``.
        ``onboard_mode``: which hits are onboarded layer-wise (``layer_onboard.py``).
        Registers ``offload`` as the block manager's eviction hook."""
        if host is None and disk is None:
            raise ValueError("KVTierManager needs at least one tier")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        # [num_blocks, block_bytes]: each row one block (every layer, K and V), as bytes.
        self._g1 = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
        self.block_bytes = self._g1.shape[1]
        self.tiers: tuple[KVTier, ...] = tuple(t for t in (host, disk) if t is not None)
        self._first = host if host is not None else staging
        if disk is not None and self._first is None:
            raise ValueError("a disk tier without a host tier needs a staging HostTier")
        assert self._first is not None
        self._lookup: tuple[KVTier, ...] = (self._first, *((disk,) if disk else ()))
        self._disk = disk
        self._disk_lock = disk_lock
        self._flush = FlushStats()
        self._writer = (
            WriteBehind(self._first, disk, self._first.capacity_blocks, inline_writes)
            if disk
            else None
        )
        # A tier that is not host memory may not read into device memory: bounce via host.
        self._bounce = (
            torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True)
            if self._g1.device.type != "cpu"
            else None
        )
        self._offloaded = self._offload_failed = self._onboarded = self._onboard_failed = 0
        self._logged = False
        self._closed = False
        # Hits copied layer group by layer group while the first chunk computes.
        self.layerwise = LayerOnboarder(
            self._g1, kv_cache.shape[1], self._lookup, self.block_size, onboard_mode
        )
        block_manager.on_evict = self.offload

    # ---- what the other parts read -------------------------------------------------
    def lookup(self, token_ids: Sequence[int], root: int = NONE_HASH) -> int:
        """Leading full blocks of ``token_ids`` (a chain from ``root``) held in G1, G2 or G3
        (cheap: hashes and set lookups, no copy; for reports and tests). Safe from any
        thread."""
        count, parent = 0, root
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            if not self.block_manager.holds(parent) and not any(
                t.contains(parent) for t in self._lookup
            ):
                break
            count += 1
        return count

    def stats(self) -> TierManagerStats:
        return TierManagerStats(
            self._offloaded,
            self._offload_failed,
            self._onboarded + self.layerwise.num_onboarded,
            self._onboard_failed + self.layerwise.num_failed,
            self._writer.stats() if self._writer else WriteBehindStats(),
            self._flush,
        )

    def wait_idle(self) -> None:
        """Block until the disk writer has written or dropped every block (tests, bench)."""
        if self._writer is not None:
            self._writer.wait_idle()

    def close(self, flush_s: float = FLUSH_S) -> FlushStats:
        """Stop the writer, write down to the disk what it lacks, and release the tiers
        (the disk tier's files stay, its directory is unlocked). The engine goes on
        without tiers: no offload, no onboarding. Idempotent.

        Call it once nothing runs the engine (a graceful shutdown: the loop has stopped).
        With a disk tier, the pool's committed blocks, then the writer's pending ones,
        most recently used first, are written within ``flush_s`` seconds (plus the
        block in hand); what does not fit is dropped and counted (``FlushStats``,
        also ``stats().flush``): a restarted server finds the prefixes the pool held."""
        if self._closed:
            return self._flush
        deadline = time.monotonic() + flush_s
        self.block_manager.on_evict = None
        self._closed = True
        pending = self._writer.close() if self._writer is not None else []
        try:
            if self._disk is not None:
                self._flush = flush(self._disk, self._flush_order(pending), deadline)
        finally:
            for tier in {id(t): t for t in self._lookup}.values():
                tier.close()
            if self._disk_lock is not None:
                self._disk_lock.release()
        return self._flush

    # ---- offload (engine thread) ---------------------------------------------------
    def offload(self, block_id: int, block_hash: int) -> None:
        """The pool is evicting ``block_id`` (holding ``block_hash``'s KV): store a copy
        below before the id is handed out. Never raises: a failed offload is a later miss."""
        try:
            stored = self._first.put(block_hash, self._host_view(block_id))
        except Exception:
            stored = False
            if not self._logged:
                logger.exception("KV tier %s: offload failed", self._first.name)
                self._logged = True
        if not stored:
            self._offload_failed += 1
            return
        self._offloaded += 1
        if self._writer is not None:
            self._writer.submit(block_hash)

    # ---- onboard (engine thread, admission) ------------------------------------------
    def find(self, token_ids: Sequence[int], prefix: PrefixHit, root: int = NONE_HASH) -> TierHit:
        """The blocks after ``prefix`` (the pool's hit) that the tiers hold, chain order,
        leaving at least the last token to compute. Changes nothing but recency: host-tier
        hits become most recent so the offloads of the coming allocation evict others."""
        if self._closed:
            return TierHit()
        max_blocks = (len(token_ids) - 1) // self.block_size
        first = prefix.num_blocks
        parent = prefix.block_hashes[-1] if first else root
        hashes: list[int] = []
        where: list[int] = []
        for i in range(first, max_blocks):
            start = i * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            index = next((j for j, t in enumerate(self._lookup) if t.contains(parent)), None)
            if index is None:
                break
            hashes.append(parent)
            where.append(index)
        for block_hash, index in zip(hashes, where, strict=True):
            tier = self._lookup[index]
            if isinstance(tier, HostTier):
                tier.touch(block_hash)
        return TierHit(tuple(hashes), tuple(where))

    def onboard(self, hit: TierHit, block_ids: Sequence[int]) -> int:
        """Copy ``hit``'s blocks into ``block_ids`` (fresh pool blocks, one per hit, in
        order); returns how many leading ones arrived. A block the tier ``find`` chose fails
        to deliver is read from a lower tier that holds it; one no tier delivers ends it: the
        request computes from that block on (never raises for a bad block)."""
        for index, tier in enumerate(self._lookup):
            prefetch = getattr(tier, "prefetch", None)  # the disk's: read ahead, all at once
            if prefetch is not None and index in hit.tier_indexes:
                pairs = zip(hit.block_hashes, hit.tier_indexes, strict=True)
                prefetch([h for h, i in pairs if i == index])
        for count, (block_hash, index, block_id) in enumerate(
            zip(hit.block_hashes, hit.tier_indexes, block_ids, strict=True)
        ):
            # A tier that fails to deliver (corrupt, evicted meanwhile): the next one down
            # may hold the block too (every host block is written behind to the disk).
            lower = [t for t in self._lookup[index + 1 :] if t.contains(block_hash)]
            if not any(self._read(t, block_hash, block_id) for t in (self._lookup[index], *lower)):
                self._onboard_failed += hit.num_blocks - count
                return count
            self._onboarded += 1
        return hit.num_blocks

    def onboard_request(
        self,
        req_id: str,
        token_ids: Sequence[int],
        prefix: PrefixHit,
        hit: TierHit,
        root: int = NONE_HASH,
    ) -> int:
        """Admission, once ``req_id`` has its blocks (the pool's ``prefix`` first, then
        fresh ones): copy ``hit`` into the fresh blocks after the prefix and publish them
        in the prefix cache like computed ones (requests admitted later in the same step
        share them). Returns the tokens now computed: the prefix plus the blocks that
        arrived (a tier's miss ends the run there)."""
        bm = self.block_manager
        first = prefix.num_blocks
        table = bm.block_table(req_id)
        num_arrived = self.onboard(hit, table[first : first + hit.num_blocks])
        num_cached = (first + num_arrived) * self.block_size
        bm.commit_computed(req_id, token_ids, num_cached, root)
        return num_cached

    def start_onboard(self, req_id: str, prefix: PrefixHit, hit: TierHit) -> int:
        """Admission, once ``req_id`` has its blocks: onboard ``hit`` layer-wise into the
        fresh blocks after ``prefix`` (``LayerOnboarder.start``; not in the prefix cache
        until the step that waits for it commits them). Returns the tokens that count as
        computed: the whole hit (the step rolls back what fails to arrive)."""
        first = prefix.num_blocks
        table = self.block_manager.block_table(req_id)
        self.layerwise.start(req_id, hit, table[first : first + hit.num_blocks], first)
        return (first + hit.num_blocks) * self.block_size

    # ---- internals -------------------------------------------------------------------
    def _flush_order(self, pending: list[int]) -> list[tuple[int, Reader]]:
        """What the disk may lack at close, most recently used first: the pool's committed
        blocks (newer than anything it evicted), then the writer's pending ones, newest
        first (read out of the host tier, if it still holds them)."""
        buf = torch.empty(self.block_bytes, dtype=torch.uint8)

        def from_pool(block_id: int) -> Reader:
            if self._bounce is None:
                return lambda: self._g1[block_id]
            return lambda: self._bounce.copy_(self._g1[block_id])  # type: ignore[union-attr]

        def from_host(block_hash: int) -> Reader:
            return lambda: buf if self._first.peek(block_hash, buf) else None

        blocks = [(h, from_pool(b)) for b, h in self.block_manager.committed_blocks()]
        return blocks + [(h, from_host(h)) for h in reversed(pending)]

    def _host_view(self, block_id: int) -> torch.Tensor:
        return self._g1[block_id]

    def _read(self, tier: KVTier, block_hash: int, block_id: int) -> bool:
        try:
            if self._bounce is None or isinstance(tier, HostTier):
                return tier.get(block_hash, self._g1[block_id])
            if not tier.get(block_hash, self._bounce):
                return False
            self._g1[block_id].copy_(self._bounce)
            return True
        except Exception:
            if not self._logged:
                logger.exception("KV tier %s: onboarding read failed", tier.name)
                self._logged = True
            return False
