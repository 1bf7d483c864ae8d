"""Paged KV-cache accounting with reference counts and prefix caching.

Pure Python (ints and lists): it decides *which* blocks a request owns; the
model runner writes the bytes. Every block is in exactly one state:

- **free**: ref_count 0, no hash; handed out first.
- **cached**: ref_count 0 but holds the KV of a full block of some prefix
  (it has a hash); reusable by a later request with the same prefix, and
  evicted in LRU order when the free list is empty.
- **in use**: ref_count > 0 (a request's block table holds it; prefix sharing and
  `fork` make it > 1). An in-use block may also have a hash.

Invariant (``check_integrity``): free + cached + in use == num_blocks.

Prefix caching uses *chained* block hashes: the hash of block i covers the
parent's hash and block i's token ids, so equal hashes mean equal prefixes. The
hash is blake2b (not Python's ``hash``) so that it is stable across processes:
the router compares hashes reported by different workers.

Eviction hands a cached block's KV to ``on_evict`` first (the KV tiers copy it down,
docs/kv-tiers.md) while its bytes are still intact.

Who frees what: the scheduler calls ``free`` when a request finishes, is
aborted or preempted; a block whose count drops to zero keeps its KV (cached)
if it was full and hashed, and the request's tail blocks are released first so
that eviction takes them before the shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from workers.protocol.block_hashes import NONE_HASH, hash_block_tokens


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(frozen=True)
class PrefixHit:
    """Blocks found in the prefix cache for a request about to be admitted."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class HashEvents(NamedTuple):
    """Hashes the pool started / stopped holding (the tiers' ``TierEvents``, torch-free)."""

    stored: tuple[int, ...]
    removed: tuple[int, ...]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: first = evicted first
        self._hash_to_block: dict[int, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Per request: hashes of its leading full blocks that are computed (len = count).
        self._hashes: dict[str, list[int]] = {}
        # Copy-on-write work for the runner: (src, dst) pairs, drained by the scheduler.
        self._pending_copies: list[tuple[int, int]] = []
        self.num_evictions = 0
        # Called with (block_id, block_hash) when a cached block is evicted, while its KV is
        # still intact: the KV tiers copy it down before the id is handed out and
        # overwritten (workers/engine/kv_tiers/manager.py). Still pure Python here.
        self.on_evict: Callable[[int, int], None] | None = None
        # Hashes this pool started / stopped holding since the last ``drain_events``, kept
        # once a reporter asks (``record_events``): a worker's reports carry these changes
        # rather than the whole set (workers/serving/worker_report.py). Off, nothing grows.
        self.record_events = False
        self._stored_events: set[int] = set()
        self._removed_events: set[int] = set()

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, req_id: str) -> list[int]:
        return self._tables.get(req_id, [])

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def holds(self, block_hash: int) -> bool:
        """Whether a block (in use or cached) holds this hash's KV."""
        return block_hash in self._hash_to_block

    def cached_block_hashes(self) -> set[int]:
        """Hashes whose KV this worker holds (in use or cached), for KV-aware routing."""
        return set(self._hash_to_block)

    # The pool as a source of KV events, as the tiers below it are (kv_tiers/tier.py).
    name = "pool"

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._hash_to_block

    def hashes(self) -> frozenset[int]:
        """Every hash held now (a snapshot for a new receiver; O(blocks))."""
        return frozenset(self._hash_to_block)

    def drain_events(self) -> HashEvents:
        """Hashes stored / removed since the previous call (``record_events`` on)."""
        events = HashEvents(tuple(self._stored_events), tuple(self._removed_events))
        self._stored_events.clear()
        self._removed_events.clear()
        return events

    def committed_blocks(self) -> list[tuple[int, int]]:
        """(block id, hash) of every block holding a committed prefix's KV, most recently
        used first: those requests hold now, then the cached ones, newest first (what the
        KV tiers write down to disk at shutdown)."""
        in_use = {b: None for table in self._tables.values() for b in table}
        order = [*in_use, *reversed(self._cached)]
        return [(b, h) for b in order if (h := self._blocks[b].block_hash) is not None]

    # ---- prefix cache ----------------------------------------------------------
    def find_prefix(self, token_ids: Sequence[int], root: int = NONE_HASH) -> PrefixHit:
        """Longest run of leading full blocks already cached, for a request whose hash
        chain starts at ``root`` (its cache salt's: block_hashes.salt_root).

        At least one token is always left to compute: the model must run on the
        last prompt token to produce logits. Does not change any state.
        """
        if not self.enable_prefix_caching:
            return PrefixHit((), ())
        max_blocks = (len(token_ids) - 1) // self.block_size
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = root
        for i in range(max_blocks):
            start = i * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            block_id = self._hash_to_block.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return PrefixHit(tuple(block_ids), tuple(hashes))

    # ---- allocation ------------------------------------------------------------
    def allocate_slots(
        self,
        req_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix: PrefixHit | None = None,
    ) -> bool:
        """Make the request's table cover its first ``num_computed_tokens + num_new_tokens`` slots.

        ``prefix`` (only on admission, when the request has no table yet) is
        taken over as the leading blocks. Returns False and changes nothing when
        too few blocks are available. Blocks that this step writes into (from
        position ``num_computed_tokens`` on) and that another table shares (after
        ``fork``) are replaced by private copies first (copy-on-write).
        """
        num_total_tokens = num_computed_tokens + num_new_tokens
        table = self._tables.get(req_id)
        prefix_ids = prefix.block_ids if prefix else ()
        if prefix_ids and table:
            raise ValueError(f"request {req_id!r} already has blocks; a prefix is for admission")
        have = len(table) if table else 0
        needed = -(-num_total_tokens // self.block_size) - have - len(prefix_ids)
        cow = self._shared_write_targets(table, num_computed_tokens)
        # Cached blocks the prefix revives stop being evictable: they don't count as available.
        revived = sum(1 for b in prefix_ids if self._blocks[b].ref_count == 0)
        if max(needed, 0) + len(cow) > self.num_free_blocks - revived:
            return False
        if table is None:
            table = self._tables[req_id] = []
            self._hashes[req_id] = []
        for block_id, block_hash in zip(
            prefix_ids, prefix.block_hashes if prefix else (), strict=True
        ):
            self._take(block_id)
            table.append(block_id)
            self._hashes[req_id].append(block_hash)
        for index in cow:
            src = table[index]
            dst = self._pop_free()
            self._release(src)
            table[index] = dst
            self._pending_copies.append((src, dst))
        for _ in range(max(needed, 0)):
            table.append(self._pop_free())
        return True

    def commit_computed(
        self, req_id: str, token_ids: Sequence[int], num_computed: int, root: int = NONE_HASH
    ) -> None:
        """Register the hashes of blocks that became full and computed (after a step ran).

        Done after the step rather than at allocation so a block never enters the
        prefix cache before its KV is actually written.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[req_id]
        hashes = self._hashes[req_id]
        num_full = min(num_computed, len(token_ids)) // self.block_size
        parent = hashes[-1] if hashes else root
        for i in range(len(hashes), num_full):
            start = i * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            hashes.append(parent)
            block = self._blocks[table[i]]
            if block.block_hash is None and parent not in self._hash_to_block:
                block.block_hash = parent
                self._hash_to_block[parent] = block.block_id
                if self.record_events:
                    self._stored_events.add(parent)
                    self._removed_events.discard(parent)
            # else: an identical block is already cached (computed twice by two requests
            # admitted together); this copy stays unhashed and is freed, not cached.

    def fork(self, parent_id: str, child_id: str) -> None:
        """Child shares all of the parent's blocks (e.g. parallel sampling)."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        table = self._tables[parent_id]
        for block_id in table:
            self._blocks[block_id].ref_count += 1
        self._tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes[parent_id])

    def free(self, req_id: str) -> None:
        """Release a request's blocks (finish, abort, preemption). Unknown ids are ignored."""
        table = self._tables.pop(req_id, None)
        self._hashes.pop(req_id, None)
        if table is None:
            return
        # Tail first into the cached LRU, so eviction takes a request's last blocks before
        # its shared prefix; uncached blocks return to the free list in ascending order, so
        # later requests get runs of consecutive ids (which merge into one KV transfer).
        uncached: list[int] = []
        for block_id in reversed(table):
            if self._release(block_id, to_free_list=False):
                uncached.append(block_id)
        self._free.extend(reversed(uncached))

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Free the request's blocks past its first ``num_tokens`` slots (speculative
        decoding's rollback). Those blocks hold no committed token, so they carry no hash
        and go back to the free list."""
        table = self._tables.get(req_id)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            block_id = table.pop()
            assert self._blocks[block_id].block_hash is None, "trimmed a committed block"
            self._release(block_id)

    def evict(self, num_blocks: int | None = None) -> int:
        """Drop up to ``num_blocks`` cached blocks (all when None), LRU first; returns how many."""
        count = 0
        while self._cached and (num_blocks is None or count < num_blocks):
            block_id, _ = self._cached.popitem(last=False)
            self._evicted(block_id)
            self._free.append(block_id)
            count += 1
        return count

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- internals -------------------------------------------------------------
    def _shared_write_targets(self, table: list[int] | None, num_computed_tokens: int) -> list[int]:
        """Indexes of table blocks this step writes into that other tables also hold."""
        if not table:
            return []
        first = num_computed_tokens // self.block_size
        return [i for i in range(first, len(table)) if self._blocks[table[i]].ref_count > 1]

    def _pop_free(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)
            self._evicted(block_id)
            self.num_evictions += 1
        self._blocks[block_id].ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._cached[block_id]
        block.ref_count += 1

    def _release(self, block_id: int, to_free_list: bool = True) -> bool:
        """Drop one reference; returns True when the block became free (not cached)."""
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return False
        if block.block_hash is not None:
            self._cached[block_id] = None
            return False
        if to_free_list:
            self._free.append(block_id)
        return True

    def _evicted(self, block_id: int) -> None:
        block_hash = self._blocks[block_id].block_hash
        if self.on_evict is not None and block_hash is not None:
            self.on_evict(block_id, block_hash)
        self._forget_hash(block_id)

    def _forget_hash(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
            if self.record_events:
                self._removed_events.add(block.block_hash)
                self._stored_events.discard(block.block_hash)
            block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError if any accounting invariant is broken."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not free & cached, "block both free and cached"
        in_use = 0
        for block in self._blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}"
            )
            if block.ref_count > 0:
                in_use += 1
                assert block.block_id not in free and block.block_id not in cached
            elif block.block_id in cached:
                assert block.block_hash is not None, f"cached block {block.block_id} has no hash"
            else:
                assert block.block_id in free, f"block {block.block_id} lost"
                assert block.block_hash is None, f"free block {block.block_id} keeps a hash"
            if block.block_hash is not None:
                assert self._hash_to_block.get(block.block_hash) == block.block_id
        assert len(self._hash_to_block) == sum(b.block_hash is not None for b in self._blocks)
        assert len(free) + len(cached) + in_use == self.num_blocks
        for req_id, hashes in self._hashes.items():
            assert len(hashes) <= len(self._tables[req_id])
