"""G2: KV blocks in host memory, one preallocated tensor of fixed-size slots.

``capacity_bytes // block_bytes`` slots of ``block_bytes`` bytes each, allocated once (pinned
when asked and CUDA is available, so that copies to and from the GPU run at full PCIe speed
and may overlap compute); a dict maps a block hash to its slot, least recently used first,
and a full tier evicts from that end. Nothing is allocated per block, so a full tier costs
no more than an empty one and never fragments.

Thread-safe: one lock guards the map *and* the copies, so a slot is never overwritten while
another thread copies out of it (the engine loop onboards and offloads into it; the disk
writer reads behind it, ``workers/engine/kv_tiers/write_behind.py``). A copy is a memcpy of
one block, so the lock is held for microseconds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.tier import TierEvents, TierStats


class HostTier:
    name = "host"

    def __init__(
        self,
        fingerprint: CacheFingerprint,
        block_bytes: int,
        capacity_bytes: int,
        pin_memory: bool = False,
    ) -> None:
        """Raises ValueError when ``capacity_bytes`` holds no block."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"host KV tier: {capacity_bytes} bytes hold no block of {block_bytes} bytes"
            )
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.capacity_blocks = num_slots
        pin = pin_memory and torch.cuda.is_available()
        # torch.empty: the OS hands out the pages as they are first written (CPU), so a
        # large, mostly empty tier costs address space, not memory.
        self._data = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot; first = LRU
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lock = threading.Lock()
        # Per hash changed since the last drain: whether it was held at that drain.
        self._changed: dict[int, bool] = {}
        self._hits = self._misses = self._evictions = 0
        self._onboard_bytes = self._offload_bytes = 0
        self._onboard_seconds = self._offload_seconds = 0.0

    # ---- KVTier ----------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._slots

    def get(self, block_hash: int, out: torch.Tensor) -> bool:
        self._check(out, "out")
        t0 = time.perf_counter()
        with self._lock:
            slot = self._slots.get(block_hash)
            if slot is None:
                self._misses += 1
                return False
            self._slots.move_to_end(block_hash)
            out.copy_(self._data[slot])
            self._hits += 1
            self._onboard_bytes += self.block_bytes
            self._onboard_seconds += time.perf_counter() - t0
        return True

    def get_range(self, block_hash: int, start: int, out: torch.Tensor) -> bool:
        """Bytes ``[start, start + out.numel())`` of the block into ``out`` (the layer-wise
        onboarding reads a block layer group by layer group; ``out`` may be on the device).
        False on a miss, which includes a block evicted since its first range: the ranges
        of one block read before must not be combined with another's. The range that ends
        the block counts the hit. Not part of :class:`KVTier`."""
        t0 = time.perf_counter()
        end = start + out.numel()
        with self._lock:
            slot = self._slots.get(block_hash)
            if slot is None:
                self._misses += 1
                return False
            # Blocking, under the lock: a put may reuse the slot as soon as it is released.
            out.copy_(self._data[slot, start:end])
            self._onboard_bytes += out.numel()
            self._onboard_seconds += time.perf_counter() - t0
            if end == self.block_bytes:
                self._slots.move_to_end(block_hash)
                self._hits += 1
        return True

    def put(self, block_hash: int, data: torch.Tensor) -> bool:
        self._check(data, "data")
        t0 = time.perf_counter()
        with self._lock:
            if not self._data.numel():  # closed
                return False
            if block_hash in self._slots:  # blocks are immutable: only its recency changes
                self._slots.move_to_end(block_hash)
                return True
            if self._free:
                slot = self._free.pop()
            else:
                victim, slot = self._slots.popitem(last=False)
                self._note(victim, held_before=True)
                self._evictions += 1
            self._data[slot].copy_(data)
            self._slots[block_hash] = slot
            self._note(block_hash, held_before=False)
            self._offload_bytes += self.block_bytes
            self._offload_seconds += time.perf_counter() - t0
        return True

    def hashes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._slots)

    def drain_events(self) -> TierEvents:
        """Net changes since the last drain: a hash stored and evicted in between (or
        evicted and stored again) appears in neither list."""
        with self._lock:
            changed, self._changed = self._changed, {}
            stored = tuple(h for h, was in changed.items() if not was and h in self._slots)
            removed = tuple(h for h, was in changed.items() if was and h not in self._slots)
        return TierEvents(stored=stored, removed=removed)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self.name,
                blocks=len(self._slots),
                bytes=len(self._slots) * self.block_bytes,
                capacity_blocks=self.capacity_blocks,
                hits=self._hits,
                misses=self._misses,
                onboard_bytes=self._onboard_bytes,
                onboard_seconds=self._onboard_seconds,
                offload_bytes=self._offload_bytes,
                offload_seconds=self._offload_seconds,
                evictions=self._evictions,
            )

    def close(self) -> None:
        with self._lock:
            for block_hash in self._slots:
                self._note(block_hash, held_before=True)
            self._slots.clear()
            self._free = []
            self._data = torch.empty((0, self.block_bytes), dtype=torch.uint8)

    # ---- beyond the protocol (the tier manager's) ------------------------------------
    def peek(self, block_hash: int, out: torch.Tensor) -> bool:
        """``get`` without refreshing recency or counting a hit: the disk writer copies
        blocks down behind this tier, which is no use of them."""
        self._check(out, "out")
        with self._lock:
            slot = self._slots.get(block_hash)
            if slot is None:
                return False
            out.copy_(self._data[slot])
        return True

    def touch(self, block_hash: int) -> bool:
        """Mark the block most recently used (a lookup found it and will onboard it, so
        offloads meanwhile evict other blocks first); False when absent."""
        with self._lock:
            if block_hash not in self._slots:
                return False
            self._slots.move_to_end(block_hash)
            return True

    def check_integrity(self) -> None:
        """Raise AssertionError if slots and hashes disagree (tests)."""
        with self._lock:
            used = list(self._slots.values())
            assert len(set(used)) == len(used), "two hashes share a slot"
            assert not set(used) & set(self._free), "a slot is both used and free"
            assert len(used) + len(self._free) == self.capacity_blocks or not self._data.numel()
            assert len(self._slots) <= self.capacity_blocks

    # ---- internals -------------------------------------------------------------------
    def _check(self, t: torch.Tensor, what: str) -> None:
        if t.dtype != torch.uint8 or t.numel() != self.block_bytes or not t.is_contiguous():
            raise ValueError(
                f"host KV tier: {what} must be a contiguous uint8 tensor of {self.block_bytes} "
                f"bytes, got {t.dtype} of {t.numel()} elements"
            )

    def _note(self, block_hash: int, held_before: bool) -> None:
        self._changed.setdefault(block_hash, held_before)
        if len(self._changed) > 4 * self.capacity_blocks + 64:
            # Nobody drains (an offline engine, the manager's internal staging tier): keep
            # only net changes, at most the blocks held at the last drain plus those held
            # now, so the record stays within twice the capacity.
            self._changed = {
                h: was for h, was in self._changed.items() if was != (h in self._slots)
            }
