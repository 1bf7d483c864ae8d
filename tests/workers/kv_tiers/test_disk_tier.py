"""The disk tier (G3) on real files: round trips, LRU, restart, events and stats.

Failure cases (corrupt, truncated, missing, foreign files; a full disk) are in
test_disk_tier_failures.py; random schedules against a model in test_disk_tier_property.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from workers.engine.kv_tiers import disk_tier
from workers.engine.kv_tiers.block_file import HEADER_LEN
from workers.engine.kv_tiers.disk_tier import DiskTier
from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.tier import KVTier, TierEvents

BLOCK_BYTES = 4096
FILE_BYTES = HEADER_LEN + BLOCK_BYTES
FP = CacheFingerprint(
    model="m-1", dtype="float32", kv_cache_dtype="auto", num_layers=2, num_kv_heads=2,
    head_dim=16, block_size=16,
)  # fmt: skip


def block(seed: int, size: int = BLOCK_BYTES) -> torch.Tensor:
    """Random bytes, a function of the seed (so a test can say what a hash must read back)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def read(tier: DiskTier, block_hash: int) -> torch.Tensor | None:
    out = torch.full((tier.block_bytes,), 7, dtype=torch.uint8)
    return out if tier.get(block_hash, out) else None


def make(root: Path, capacity_blocks: int = 8, fp: CacheFingerprint = FP) -> DiskTier:
    return DiskTier(root, fp, BLOCK_BYTES, capacity_blocks * FILE_BYTES)


def test_is_a_kv_tier_and_round_trips_random_bytes(tmp_path: Path) -> None:
    tier: KVTier = make(tmp_path)
    hashes = [0, 1, 2**64 - 1, 0x1234_5678_9ABC_DEF0]  # the hash is an unsigned 64-bit int
    for h in hashes:
        assert tier.put(h, block(h % 1000))
    for h in hashes:
        got = read(tier, h)
        assert got is not None and torch.equal(got, block(h % 1000))
        assert tier.contains(h)
    assert read(tier, 3) is None and not tier.contains(3)
    assert tier.hashes() == frozenset(hashes)
    files = sorted(p.name for p in (tmp_path / FP.digest).iterdir())
    assert files == sorted(f"{h:016x}.kvb" for h in hashes)
    assert all((tmp_path / FP.digest / f).stat().st_size == FILE_BYTES for f in files)


def test_data_may_be_reused_by_the_caller_after_put(tmp_path: Path) -> None:
    tier = make(tmp_path)
    data = block(1)
    assert tier.put(5, data)
    data.zero_()
    got = read(tier, 5)
    assert got is not None and torch.equal(got, block(1))


def test_lru_eviction_at_capacity_follows_gets_and_puts(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity_blocks=3)
    for h in (1, 2, 3):
        assert tier.put(h, block(h))
    assert read(tier, 1) is not None  # 1 is now the most recent: 2 goes first
    assert tier.put(4, block(4))
    assert tier.hashes() == {1, 3, 4}
    assert tier.put(3, block(3))  # a put of a held block refreshes it: 1 goes next
    assert tier.put(5, block(5))
    assert tier.hashes() == {3, 4, 5}
    assert not (tmp_path / FP.digest / f"{2:016x}.kvb").exists()
    stats = tier.stats()
    assert (stats.blocks, stats.bytes, stats.capacity_blocks) == (3, 3 * FILE_BYTES, 3)
    assert stats.evictions == 2
    assert stats.offload_bytes == 5 * BLOCK_BYTES  # the refresh wrote nothing
    tier.check_integrity()


def test_a_capacity_below_one_block_rejects_every_put(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, FILE_BYTES - 1)
    assert not tier.put(1, block(1))
    assert tier.stats().rejected == 1 and tier.stats().capacity_blocks == 0
    assert tier.hashes() == frozenset()


def test_restart_finds_the_blocks_byte_equal_in_lru_order(tmp_path: Path) -> None:
    first = make(tmp_path, capacity_blocks=4)
    for h in (10, 11, 12, 13):
        assert first.put(h, block(h))
    assert read(first, 10) is not None  # recency: 11 < 12 < 13 < 10
    first.close()

    second = make(tmp_path, capacity_blocks=4)
    assert second.hashes() == {10, 11, 12, 13}
    for h in (10, 11, 12, 13):
        got = read(second, h)
        assert got is not None and torch.equal(got, block(h))
    # The order survived the restart (then these reads made it 10 < 11 < 12 < 13).
    third = make(tmp_path, capacity_blocks=3)  # trims the least recent at start
    assert third.hashes() == {11, 12, 13}
    assert third.stats().evictions == 1
    assert not (tmp_path / FP.digest / f"{10:016x}.kvb").exists()


def test_restart_reports_found_blocks_as_stored_events(tmp_path: Path) -> None:
    first = make(tmp_path, capacity_blocks=4)
    for h in (1, 2, 3):
        first.put(h, block(h))
    second = make(tmp_path, capacity_blocks=2)
    # A restarted worker's router knows nothing of it: what it kept is news; what it
    # trimmed at start was never announced.
    assert sorted(second.drain_events().stored) == [2, 3]
    assert second.drain_events() == TierEvents()


def test_another_fingerprint_never_sees_the_blocks(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert tier.put(1, block(1))
    other_fp = CacheFingerprint(
        model="m-2", dtype="float32", kv_cache_dtype="auto", num_layers=2, num_kv_heads=2,
        head_dim=16, block_size=16,
    )  # fmt: skip
    other = make(tmp_path, fp=other_fp)
    assert other.hashes() == frozenset() and read(other, 1) is None
    assert other.put(1, block(2))  # its own file, in its own directory
    got = read(tier, 1)
    assert got is not None and torch.equal(got, block(1))


def test_events_report_stored_and_removed_net_of_each_drain(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity_blocks=2)
    assert tier.drain_events() == TierEvents()
    tier.put(1, block(1))
    tier.put(2, block(2))
    assert sorted(tier.drain_events().stored) == [1, 2]
    tier.put(3, block(3))  # evicts 1
    tier.put(4, block(4))  # evicts 2
    tier.put(5, block(5))  # evicts 3: stored and removed within one window, never news
    events = tier.drain_events()
    assert sorted(events.stored) == [4, 5] and sorted(events.removed) == [1, 2]
    tier.put(1, block(1))  # evicts 4
    events = tier.drain_events()
    assert events == TierEvents(stored=(1,), removed=(4,))
    assert tier.drain_events() == TierEvents()


def test_stats_count_hits_misses_and_bytes(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put(1, block(1))
    tier.put(2, block(2))
    read(tier, 1)
    read(tier, 1)
    read(tier, 9)
    stats = tier.stats()
    assert (stats.name, stats.hits, stats.misses, stats.errors) == ("disk", 2, 1, 0)
    assert stats.onboard_bytes == 2 * BLOCK_BYTES and stats.offload_bytes == 2 * BLOCK_BYTES
    assert stats.onboard_seconds > 0 and stats.offload_seconds > 0
    assert (stats.blocks, stats.bytes, stats.rejected, stats.evictions) == (2, 2 * FILE_BYTES, 0, 0)


def test_close_keeps_the_files_and_refuses_new_work(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put(1, block(1))
    tier.close()
    assert not tier.put(2, block(2))
    assert read(tier, 1) is None
    assert make(tmp_path).hashes() == {1}


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(BLOCK_BYTES, dtype=torch.float32),
        torch.zeros(BLOCK_BYTES - 1, dtype=torch.uint8),
        torch.zeros(2 * BLOCK_BYTES, dtype=torch.uint8)[::2],
    ],
    ids=["dtype", "size", "strided"],
)
def test_a_wrong_buffer_is_a_clear_error(tmp_path: Path, bad: torch.Tensor) -> None:
    tier = make(tmp_path)
    with pytest.raises(ValueError, match="contiguous uint8 tensor of 4096 bytes"):
        tier.put(1, bad)
    with pytest.raises(ValueError, match="contiguous uint8 tensor of 4096 bytes"):
        tier.get(1, bad)


@pytest.mark.parametrize("bad_hash", [-1, 2**64])
def test_a_hash_out_of_range_is_a_clear_error(tmp_path: Path, bad_hash: int) -> None:
    tier = make(tmp_path)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        tier.put(bad_hash, block(1))
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        read(tier, bad_hash)


def test_puts_on_one_thread_and_gets_on_another_never_read_wrong_bytes(tmp_path: Path) -> None:
    tier = make(tmp_path, capacity_blocks=6)
    num_blocks = 60
    done = threading.Event()
    failures: list[str] = []

    def offload() -> None:
        for h in range(num_blocks):
            tier.put(h, block(h))
        done.set()

    writer = threading.Thread(target=offload)
    writer.start()
    num_hits = 0
    while not done.is_set() or num_hits == 0:
        for h in range(num_blocks):
            got = read(tier, h)
            if got is not None:
                num_hits += 1
                if not torch.equal(got, block(h)):
                    failures.append(f"block {h}: wrong bytes")
    writer.join()
    assert failures == []
    assert tier.stats().errors == 0  # an eviction racing a read is a plain miss
    # Reads refresh recency, so which six survive depends on the interleaving; the index
    # and the directory must agree on them.
    held = tier.hashes()
    assert len(held) == 6 and num_blocks - 1 in held
    tier.check_integrity()  # the directory holds exactly these six


def test_prefetch_reads_a_window_ahead_of_the_gets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make(tmp_path, capacity_blocks=20)
    for h in range(10):
        tier.put(h, block(h))
    advised: list[int] = []
    real_advise = tier._advise
    monkeypatch.setattr(tier, "_advise", lambda hs: advised.extend(hs) or real_advise(hs))
    monkeypatch.setattr(disk_tier, "PREFETCH_BYTES", 3 * FILE_BYTES)
    assert tier.prefetch([*range(8), 99]) == 8  # 99 is not held
    assert advised == [0, 1, 2]  # the window
    for h in range(8):
        got = read(tier, h)
        assert got is not None and torch.equal(got, block(h))
        # Each get starts the next block: three stay in flight ahead of the reader.
        assert advised == list(range(min(8, h + 4)))
    assert tier.prefetch([9]) == 1 and advised[-1] == 9
    tier.prefetch(range(8))  # a new call replaces what was left of the previous one
    tier.prefetch([])
    read(tier, 0)
    assert advised[-3:] == [0, 1, 2]


def test_prefetch_is_a_hint_for_held_blocks_only(tmp_path: Path) -> None:
    tier = make(tmp_path)
    for h in (1, 2, 3):
        tier.put(h, block(h))
    (tmp_path / FP.digest / f"{3:016x}.kvb").unlink()  # gone behind the tier's back
    assert tier.prefetch([1, 2, 3, 4]) == 3  # 4 is not held; 3's file fails quietly
    for h in (1, 2):
        got = read(tier, h)
        assert got is not None and torch.equal(got, block(h))
    assert read(tier, 3) is None and tier.stats().errors == 1  # get reports it


def test_check_integrity_sees_a_file_the_index_does_not_hold(tmp_path: Path) -> None:
    tier = make(tmp_path)
    tier.put(1, block(1))
    tier.check_integrity()
    (tmp_path / FP.digest / f"{1:016x}.kvb").rename(tmp_path / FP.digest / f"{2:016x}.kvb")
    with pytest.raises(AssertionError, match="disagree with the index"):
        tier.check_integrity()
