"""HostTier (G2): the KVTier contract on a preallocated slot tensor, exact ids and order."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.tier import KVTier, TierEvents

FP = CacheFingerprint("m", "float32", "auto", 2, 2, 16, 8)
BYTES = 64


def block(value: int) -> torch.Tensor:
    return torch.full((BYTES,), value, dtype=torch.uint8)


def test_put_get_round_trip_and_lru_eviction_order():
    tier: KVTier = HostTier(FP, BYTES, 3 * BYTES + 10)  # the 10 spare bytes hold no block
    assert tier.stats().capacity_blocks == 3
    for h in (1, 2, 3):
        assert tier.put(h, block(h))
    out = torch.empty(BYTES, dtype=torch.uint8)
    assert tier.get(1, out) and torch.equal(out, block(1))  # 1 is now the most recent
    assert tier.put(2, block(99))  # already held: recency only, bytes unchanged
    assert tier.put(4, block(4))  # evicts the LRU one: 3
    assert tier.hashes() == {1, 2, 4}
    assert not tier.contains(3) and not tier.get(3, out)
    assert tier.get(2, out) and torch.equal(out, block(2))
    assert tier.put(5, block(5))  # evicts 1 (2 was read after it)
    assert tier.hashes() == {2, 4, 5}
    s = tier.stats()
    assert (s.blocks, s.bytes, s.hits, s.misses, s.evictions) == (3, 3 * BYTES, 2, 1, 2)
    assert s.offload_bytes == 5 * BYTES and s.onboard_bytes == 2 * BYTES
    tier.check_integrity()


def test_events_are_net_changes_since_the_last_drain():
    tier = HostTier(FP, BYTES, 2 * BYTES)
    tier.put(1, block(1))
    tier.put(2, block(2))
    assert tier.drain_events() == TierEvents(stored=(1, 2), removed=())
    tier.put(3, block(3))  # evicts 1
    tier.put(4, block(4))  # evicts 2
    tier.put(1, block(1))  # evicts 3: stored and removed since the drain, so no event
    events = tier.drain_events()
    assert set(events.stored) == {4} and set(events.removed) == {2}
    assert tier.drain_events() == TierEvents()
    tier.close()
    assert set(tier.drain_events().removed) == {4, 1}
    assert not tier.put(5, block(5)) and not tier.contains(5)  # closed: refuses, holds nothing


def test_peek_and_touch_leave_counters_alone():
    tier = HostTier(FP, BYTES, 2 * BYTES)
    tier.put(1, block(1))
    tier.put(2, block(2))
    out = torch.empty(BYTES, dtype=torch.uint8)
    assert tier.peek(1, out) and torch.equal(out, block(1))
    tier.put(3, block(3))  # peek did not refresh 1: it is evicted
    assert tier.hashes() == {2, 3}
    assert tier.touch(2) and not tier.touch(1)
    tier.put(4, block(4))  # touch refreshed 2: 3 goes
    assert tier.hashes() == {2, 4}
    assert tier.stats().hits == 0 and tier.stats().misses == 0


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"capacity_bytes": BYTES - 1}, "hold no block"),
        ({"block_bytes": 0}, "block_bytes must be positive"),
    ],
)
def test_bad_sizes_are_clear_errors(kwargs, words):
    args = {"fingerprint": FP, "block_bytes": BYTES, "capacity_bytes": BYTES} | kwargs
    with pytest.raises(ValueError, match=words):
        HostTier(**args)


def test_wrong_buffer_is_a_clear_error():
    tier = HostTier(FP, BYTES, BYTES)
    with pytest.raises(ValueError, match="contiguous uint8 tensor of 64 bytes"):
        tier.put(1, torch.zeros(BYTES, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous uint8"):
        tier.get(1, torch.zeros(BYTES + 1, dtype=torch.uint8))


def test_concurrent_puts_and_gets_never_return_torn_blocks():
    tier = HostTier(FP, BYTES, 4 * BYTES)
    bad: list[int] = []

    def writer(base: int) -> None:
        for i in range(300):
            h = base + i % 7
            tier.put(h, block(h % 256))

    def reader() -> None:
        out = torch.empty(BYTES, dtype=torch.uint8)
        for i in range(600):
            h = (i % 2) * 1000 + i % 7
            if tier.get(h, out) and not torch.equal(out, block(h % 256)):
                bad.append(h)

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 1000)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    tier.check_integrity()
    assert tier.stats().blocks == 4


def test_undrained_events_stay_bounded_and_exact():
    tier = HostTier(FP, BYTES, 2 * BYTES)
    tier.put(1, block(1))
    tier.drain_events()
    for h in range(2, 500):  # nobody drains meanwhile
        tier.put(h, block(h % 256))
    assert len(tier._changed) <= 4 * 2 + 64
    events = tier.drain_events()
    assert set(events.stored) == {498, 499} and set(events.removed) == {1}
