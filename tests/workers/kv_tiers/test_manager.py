"""KVTierManager without a model: offload on eviction, write-behind to a slow or failing
lower tier, lookup across tiers, the fingerprint, and the single-rank refusal."""

from __future__ import annotations

import shutil
import threading
from collections import OrderedDict

import pytest
import torch

from cluster.tools.make_model import make_model
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.kv_tiers.build import cache_fingerprint, check_single_rank_tiers
from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.manager import KVTierManager
from workers.engine.kv_tiers.model_digest import model_digest
from workers.engine.kv_tiers.tier import TierEvents, TierStats
from workers.models.parallel import ParallelContext
from workers.protocol.block_hashes import hash_prompt_blocks

BS = 4
FP = CacheFingerprint("m", "uint8", "auto", 1, 1, 1, BS)


class DictTier:
    """A lower tier in a dict (the fake of a disk), LRU, with switches that make it fail:
    ``fail_gets`` (every get a miss), ``fail_puts`` (put refused), ``gate`` (put waits)."""

    name = "disk"

    def __init__(self, block_bytes: int, capacity_blocks: int) -> None:
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[int, bytes] = OrderedDict()
        self.lock = threading.Lock()
        self.fail_gets = self.fail_puts = False
        self.gate: threading.Event | None = None
        self.hits = 0

    def contains(self, block_hash: int) -> bool:
        with self.lock:
            return block_hash in self.blocks

    def get(self, block_hash: int, out: torch.Tensor) -> bool:
        with self.lock:
            data = None if self.fail_gets else self.blocks.get(block_hash)
            if data is None:
                return False
            self.blocks.move_to_end(block_hash)
            self.hits += 1
        out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return True

    def put(self, block_hash: int, data: torch.Tensor) -> bool:
        if self.gate is not None:
            self.gate.wait()
        with self.lock:
            if self.fail_puts:
                return False
            self.blocks[block_hash] = bytes(data.numpy())
            self.blocks.move_to_end(block_hash)
            while len(self.blocks) > self.capacity_blocks:
                self.blocks.popitem(last=False)
        return True

    def hashes(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self.blocks)

    def drain_events(self) -> TierEvents:
        return TierEvents()

    def stats(self) -> TierStats:
        with self.lock:
            return TierStats(self.name, len(self.blocks), capacity_blocks=self.capacity_blocks)

    def close(self) -> None:
        pass


def make_pool(num_blocks: int = 4) -> tuple[torch.Tensor, BlockManager]:
    kv = torch.zeros((num_blocks, 1, 2, 1, BS, 1), dtype=torch.uint8)  # 8 bytes per block
    return kv, BlockManager(num_blocks, BS)


def fill_and_cache(kv: torch.Tensor, bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """A request computes ``tokens`` (its blocks get recognisable bytes) and finishes."""
    assert bm.allocate_slots(rid, 0, len(tokens))
    for block_id in bm.block_table(rid):
        kv[block_id] = block_id + 1
    bm.commit_computed(rid, tokens, len(tokens))
    bm.free(rid)


def test_eviction_copies_the_block_down_before_its_id_is_reused():
    kv, bm = make_pool(2)
    host = HostTier(FP, 8, 8 * 4)
    mgr = KVTierManager(kv, bm, host)
    tokens = list(range(2 * BS))
    fill_and_cache(kv, bm, "a", tokens)
    hashes = hash_prompt_blocks(tokens, BS)
    assert bm.allocate_slots("b", 0, 2 * BS)  # both cached blocks are evicted and reused
    assert host.hashes() == set(hashes)
    out = torch.empty(8, dtype=torch.uint8)
    for block_id, h in enumerate(hashes):
        assert host.get(h, out) and torch.equal(out, torch.full((8,), block_id + 1).byte())
    assert mgr.stats().offloaded == 2
    assert mgr.lookup([*tokens, 99]) == 2  # in G2 only now
    bm.free("b")
    bm.check_integrity()


def test_a_slow_lower_tier_drops_offloads_and_never_blocks_the_engine():
    kv, bm = make_pool(1)
    host = HostTier(FP, 8, 8 * 16)
    disk = DictTier(8, 100)
    disk.gate = threading.Event()  # the disk hangs
    mgr = KVTierManager(kv, bm, host, disk)
    assert mgr._writer is not None
    mgr._writer.max_pending = 2
    tokens = list(range(BS))
    for i in range(6):  # each round evicts the previous round's block: 5 offloads
        fill_and_cache(kv, bm, f"r{i}", [t + 100 * i for t in tokens])
    bm.evict()  # the sixth
    assert mgr.stats().offloaded == 6  # the host tier took every one, at once
    disk.gate.set()
    mgr.wait_idle()
    w = mgr.stats().writer
    assert w.submitted == 6 and w.written + w.dropped == 6 and w.dropped >= 3
    assert len(disk.blocks) == w.written
    mgr.close()


def test_a_failing_lower_tier_counts_failures_and_serving_goes_on():
    kv, bm = make_pool(1)
    disk = DictTier(8, 100)
    disk.fail_puts = True
    staging = HostTier(FP, 8, 8 * 4)
    mgr = KVTierManager(kv, bm, None, disk, staging)
    assert mgr.tiers == (disk,)  # staging is internal
    fill_and_cache(kv, bm, "a", list(range(BS)))
    bm.evict()
    mgr.wait_idle()
    assert mgr.stats().writer.failed == 1 and not disk.blocks
    mgr.close()


def test_onboard_stops_at_the_first_unreadable_block():
    kv, bm = make_pool(4)
    host = HostTier(FP, 8, 8 * 8)
    disk = DictTier(8, 100)
    mgr = KVTierManager(kv, bm, host, disk)
    tokens = list(range(3 * BS + 1))
    fill_and_cache(kv, bm, "a", tokens)
    bm.evict()
    mgr.wait_idle()
    prefix = bm.find_prefix(tokens)
    hit = mgr.find(tokens, prefix)
    assert (prefix.num_blocks, hit.num_blocks, hit.tier_indexes) == (0, 3, (0, 0, 0))
    hashes = hit.block_hashes
    host.close()  # the host tier loses everything; the disk copies are unreadable at first
    assert mgr.find(tokens, prefix).tier_indexes == (1, 1, 1)  # the disk has them all
    disk.fail_gets = True
    assert bm.allocate_slots("b", 3 * BS, 1)
    table = bm.block_table("b")
    assert mgr.onboard(mgr.find(tokens, prefix), table[:3]) == 0
    assert mgr.stats().onboard_failed == 3
    disk.fail_gets = False
    assert mgr.onboard(mgr.find(tokens, prefix), table[:3]) == 3
    for block_id, h in zip(table[:3], hashes, strict=True):
        assert bytes(kv[block_id].flatten().numpy()) == disk.blocks[h]
    assert mgr.lookup(tokens) == 3  # all on disk (and G1 holds none of them: not committed)
    bm.commit_computed("b", tokens, 3 * BS)
    disk.blocks.clear()
    assert mgr.lookup(tokens) == 3  # now all in G1
    bm.free("b")
    mgr.close()


def test_fingerprint_names_the_checkpoint_not_its_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_model(a, "qwen2", "tiny", overwrite=True)
    shutil.copytree(a, b)
    assert model_digest(a) == model_digest(b)
    weights = next(b.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert model_digest(a) != model_digest(b)
    kv = torch.zeros((2, 2, 2, 2, 8, 16))
    fa = cache_fingerprint(EngineConfig(model=str(a)), kv)
    assert fa == cache_fingerprint(EngineConfig(model=str(tmp_path / "a")), kv)
    assert fa.digest != cache_fingerprint(EngineConfig(model=str(b)), kv).digest
    q = cache_fingerprint(EngineConfig(model=str(a), quantization="fp8"), kv)
    assert q.digest != fa.digest
    assert cache_fingerprint(EngineConfig(model=str(a)), kv.bfloat16()).dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"no config\.json"):
        model_digest(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [({"kv_host_tier_gib": 1.0}, "kv_host_tier_gib"), ({"kv_disk_tier_path": "/x"}, "disk")],
)
def test_parallel_replicas_refuse_tiers(kwargs, setting):
    config = EngineConfig(model="m", **kwargs)
    check_single_rank_tiers(config, ParallelContext())
    for parallel in (ParallelContext(0, 2), ParallelContext(pp_rank=0, pp_size=2)):
        with pytest.raises(ValueError, match=f"{setting}.*single-rank"):
            check_single_rank_tiers(config, parallel)


def test_after_close_the_pool_runs_without_tiers():
    kv, bm = make_pool(2)
    host = HostTier(FP, 8, 8 * 4)
    mgr = KVTierManager(kv, bm, host)
    tokens = list(range(2 * BS + 1))
    fill_and_cache(kv, bm, "a", tokens[: 2 * BS])
    bm.evict()
    assert mgr.find(tokens, bm.find_prefix(tokens)).num_blocks == 2
    mgr.close()
    assert bm.on_evict is None
    assert mgr.find(tokens, bm.find_prefix(tokens)).num_blocks == 0
    fill_and_cache(kv, bm, "b", tokens[: 2 * BS])
    bm.evict()  # nothing offloaded, nothing raised
    assert mgr.stats().offloaded == 2
    bm.check_integrity()


class FailingHost(HostTier):
    """A host tier whose reads all fail (as a block evicted between find and get)."""

    def get(self, block_hash: int, out: torch.Tensor) -> bool:
        return False


def test_a_block_the_host_fails_to_deliver_is_read_from_the_disk():
    kv, bm = make_pool(4)
    host = FailingHost(FP, 8, 8 * 8)
    disk = DictTier(8, 100)
    mgr = KVTierManager(kv, bm, host, disk)
    tokens = list(range(3 * BS + 1))
    fill_and_cache(kv, bm, "a", tokens)
    bm.evict()
    mgr.wait_idle()
    hashes = hash_prompt_blocks(tokens, BS)
    del disk.blocks[hashes[1]]  # the second block is in the (failing) host tier only
    prefix = bm.find_prefix(tokens)
    hit = mgr.find(tokens, prefix)
    assert hit.tier_indexes == (0, 0, 0)  # the host tier is asked first
    assert bm.allocate_slots("b", 3 * BS, 1)
    table = bm.block_table("b")
    assert mgr.onboard(hit, table[:3]) == 1  # the first from disk; the second from nowhere
    assert bytes(kv[table[0]].flatten().numpy()) == disk.blocks[hashes[0]]
    assert (mgr.stats().onboarded, mgr.stats().onboard_failed, disk.hits) == (1, 2, 1)
    bm.free("b")
    mgr.close()
