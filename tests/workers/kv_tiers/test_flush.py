"""The write-down at close (``KVTierManager.close``, ``flush.py``) without a model: the
pool's committed blocks and the disk writer's pending ones reach the disk, most recently
used first and stamped in recency order; a slow disk gets what fits in the time limit and
the rest is counted as dropped; no more than the disk holds is written."""

from __future__ import annotations

import threading
import time

import torch

from tests.workers.kv_tiers.test_manager import BS, FP, DictTier, fill_and_cache, make_pool
from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.manager import KVTierManager
from workers.protocol.block_hashes import hash_prompt_blocks


class SlowTier(DictTier):
    """A disk whose every write takes ``put_s`` (data written: a recency refresh is free)."""

    def __init__(self, block_bytes: int, capacity_blocks: int, put_s: float) -> None:
        super().__init__(block_bytes, capacity_blocks)
        self.put_s = put_s

    def put(self, block_hash: int, data: torch.Tensor) -> bool:
        if not self.contains(block_hash):
            time.sleep(self.put_s)
        return super().put(block_hash, data)


def cache_prompts(kv, bm, num: int, first: int = 0) -> list[int]:
    """Requests ``first`` .. ``first + num - 1`` compute one block each and finish, oldest
    first; returns their block hashes."""
    hashes: list[int] = []
    for i in range(first, first + num):
        tokens = [1000 * i + t for t in range(BS)]
        fill_and_cache(kv, bm, f"r{i}", tokens)
        hashes += hash_prompt_blocks(tokens, BS)
    return hashes


def test_close_writes_the_pool_and_the_pending_blocks_down_in_recency_order():
    kv, bm = make_pool(4)
    host = HostTier(FP, 8, 8 * 16)
    disk = DictTier(8, 100)
    disk.gate = threading.Event()  # the disk hangs: evicted blocks stay pending
    mgr = KVTierManager(kv, bm, host, disk)
    r = cache_prompts(kv, bm, 4)
    bm.evict(3)  # r0..r2 go to the host tier; the writer takes r0 and waits on the disk
    r += cache_prompts(kv, bm, 2, first=4)  # into free blocks: the pool holds r3..r5
    assert [h for _, h in bm.committed_blocks()] == [r[5], r[4], r[3]]  # newest first
    pool = {h: bytes(kv[b].flatten().numpy()) for b, h in bm.committed_blocks()}
    threading.Timer(0.2, disk.gate.set).start()  # the disk recovers during close
    done = mgr.close(flush_s=30)
    assert bm.on_evict is None
    # The writer finished r0 (in hand); close wrote the pool's three and the pending r1, r2.
    assert (done.written, done.dropped, done.failed) == (5, 0, 0)
    assert mgr.stats().flush == done and mgr.stats().writer.written == 1
    for h, data in pool.items():
        assert disk.blocks[h] == data
    # Least recently used first, as the pool and the writer's queue had them: the
    # restarted tier's LRU order is the pool's.
    assert list(disk.blocks) == r
    assert mgr.close() == done  # idempotent: nothing written twice


def test_a_slow_disk_gets_what_fits_in_the_limit_and_the_rest_is_counted():
    put_s, flush_s, num = 0.05, 0.2, 40
    kv, bm = make_pool(num)
    disk = SlowTier(8, 100, put_s)
    mgr = KVTierManager(kv, bm, None, disk, HostTier(FP, 8, 8 * 4))
    hashes = cache_prompts(kv, bm, num)
    done = mgr.close(flush_s=flush_s)
    # The limit allows flush_s / put_s writes, plus the one in progress at the deadline
    # (a loaded machine writes fewer, never more); the rest is dropped, not waited for.
    assert 1 <= done.written <= flush_s / put_s + 1
    assert done.dropped == num - done.written and done.failed == 0
    assert set(disk.blocks) == set(hashes[::-1][: done.written])  # the most recent ones


def test_no_more_than_the_disk_holds_is_written_and_held_blocks_are_kept():
    kv, bm = make_pool(8)
    disk = DictTier(8, 3)
    mgr = KVTierManager(kv, bm, HostTier(FP, 8, 8 * 4), disk, inline_writes=True)
    hashes = cache_prompts(kv, bm, 6)
    disk.put(hashes[-1], kv[bm.committed_blocks()[0][0]].flatten())  # the newest: held
    disk.put(12345, torch.zeros(8, dtype=torch.uint8))  # newer on disk, not in the pool
    done = mgr.close()
    # The 3 newest count: the held one is kept (refreshed before the writes evict), two
    # written; the other three lacking are dropped.
    assert (done.written, done.dropped, done.failed) == (2, 3, 0)
    assert list(disk.blocks) == hashes[-3:]


def test_close_without_a_disk_writes_nothing():
    kv, bm = make_pool(2)
    mgr = KVTierManager(kv, bm, HostTier(FP, 8, 8 * 4))
    cache_prompts(kv, bm, 2)
    assert mgr.close() == mgr.stats().flush
    assert mgr.stats().flush.written == 0
