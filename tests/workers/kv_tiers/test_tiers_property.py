"""Random schedules against the scheduler, the block manager and the KV tiers, with a fake
model that writes, for every position, a byte derived from the tokens up to it.

Rules: new requests and next turns of finished ones, steps (with preemption: the pool is
small), aborts, pool evictions, host and disk reads and writes that fail on demand, and
worker death (a new pool, host tier and scheduler over the same disk, reopened from its
directory in the real disk tier's variant). The disk is written inline (no thread), so
that a schedule replays exactly.

Checked after every rule: the pool's accounting (``check_integrity``), each tier's slots
and capacity, and that every block any tier or the pool holds under a hash has exactly the
bytes that hash's tokens produce (so an offload copied its block before the id was reused,
and an onboarding copied the right block). Checked at every step: the model never writes a
position whose block is already committed (what was found or onboarded is not computed
again) and reads the right bytes at every context position (never stale KV).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.workers.kv_tiers.test_manager import DictTier
from workers.engine.block_manager import BlockManager
from workers.engine.kv_cache import copy_blocks
from workers.engine.kv_tiers.disk_tier import DiskTier
from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.manager import KVTierManager
from workers.engine.request import FinishReason, Request
from workers.engine.scheduler import Scheduler
from workers.protocol.block_hashes import hash_prompt_blocks
from workers.protocol.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 8
FP = CacheFingerprint("m", "uint8", "auto", 1, 1, 1, BS)
# Prompts share prefixes of whole blocks, so that later requests find earlier ones' blocks.
BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]
MIDDLES = [[], [0, 1, 2, 3], [0, 1, 2, 3, 3, 2, 1, 0], [2, 2, 2, 2]]


def position_bytes(tokens: list[int]) -> list[int]:
    """The fake model's KV byte at each position: a function of the tokens up to it."""
    out, x = [], 17
    for t in tokens:
        x = (x * 1000003 ^ t) & 0xFFFFFFFF
        out.append(x % 251 + 1)  # never 0: a block never written reads as wrong
    return out


def block_bytes(values: list[int]) -> bytes:
    """A block's bytes in the pool's layout [1 layer, K/V, 1 head, BS, 1]."""
    return bytes(values + [255 - v for v in values])


class FlakyHost(HostTier):
    fail_gets = False

    def get(self, block_hash: int, out: torch.Tensor) -> bool:
        return False if self.fail_gets else super().get(block_hash, out)


class TierSchedules(RuleBasedStateMachine):
    """With a dict as the disk, whose reads and writes can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.truth: dict[int, bytes] = {}  # block hash -> the bytes its tokens produce
        self.history: list[list[int]] = []  # finished requests' tokens, deduplicated
        self.next_id = 0
        self.disk = self.open_disk()
        self.start()

    def open_disk(self) -> DictTier:
        return DictTier(2 * BS, 9)

    def start(self) -> None:
        """A worker (re)starts: an empty pool and host tier, no requests; the disk stays."""
        self.kv = torch.zeros((NUM_BLOCKS, 1, 2, 1, BS, 1), dtype=torch.uint8)
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.host = FlakyHost(FP, 2 * BS, 2 * BS * 6)
        self.mgr = KVTierManager(self.kv, self.bm, self.host, self.disk, inline_writes=True)
        self.sched = Scheduler(self.bm, max_num_seqs=4, max_num_batched_tokens=10, tiers=self.mgr)
        self.disk_hits_before = self.disk_hits()

    def disk_hits(self) -> int:
        return self.disk.hits

    def disk_blocks(self) -> dict[int, bytes]:
        with self.disk.lock:
            return dict(self.disk.blocks)

    def teardown(self) -> None:
        self.mgr.close()

    @precondition(lambda self: self.disk.hashes())  # else a restart only forgets
    @rule()
    def restart(self) -> None:
        """The worker dies (its requests with it) and a new one starts on the same disk."""
        self.mgr.close()
        self.disk = self.reopen_disk()
        self.start()

    def reopen_disk(self) -> DictTier:
        return self.disk

    def learn(self, tokens: list[int]) -> None:
        values = position_bytes(tokens)
        for i, h in enumerate(hash_prompt_blocks(tokens, BS)):
            self.truth[h] = block_bytes(values[i * BS : (i + 1) * BS])

    @rule(base=st.sampled_from(BASES), middle=st.sampled_from(MIDDLES),
          tail=st.lists(st.integers(0, 3), max_size=3), max_tokens=st.integers(1, 8))  # fmt: skip
    def add(self, base: list[int], middle: list[int], tail: list[int], max_tokens: int) -> None:
        self.submit(base + middle + tail, max_tokens)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), max_tokens=st.integers(1, 8))
    def again(self, data: st.DataObject, max_tokens: int) -> None:
        """The next turn of a conversation: an earlier request's prompt and output."""
        self.submit(data.draw(st.sampled_from(self.history)), max_tokens)

    def submit(self, prompt: list[int], max_tokens: int) -> None:
        req = Request(f"r{self.next_id}", prompt, SamplingParams(max_tokens=max_tokens),
                      max_tokens, frozenset())  # fmt: skip
        self.next_id += 1
        self.learn(prompt)
        self.sched.add(req)

    @rule(num=st.integers(1, 3))
    def step(self, num: int) -> None:
        for _ in range(num):
            self.one_step()

    def one_step(self) -> None:
        out = self.sched.schedule()
        copy_blocks(self.kv, out.block_copies)
        for chunk in out.chunks:
            req = self.sched.requests[chunk.request_id]
            values = position_bytes(req.token_ids)
            table = chunk.block_ids
            for pos in range(chunk.start_pos):  # attention reads the context
                block, off = table[pos // BS], pos % BS
                assert int(self.kv[block, 0, 0, 0, off, 0]) == values[pos], "stale KV read"
            for pos in range(chunk.start_pos, chunk.start_pos + chunk.num_tokens):
                block, off = table[pos // BS], pos % BS
                assert self.bm._blocks[block].block_hash is None, "recomputed a committed block"
                self.kv[block, 0, 0, 0, off, 0] = values[pos]
                self.kv[block, 0, 1, 0, off, 0] = 255 - values[pos]
        for chunk in out.chunks:
            req = self.sched.update_computed(chunk)
            if chunk.needs_sample:
                req.append_token(sum(req.token_ids) % 4)
                self.learn(req.token_ids)
                if req.num_output_tokens >= req.max_tokens:
                    self.sched.finish(req, FinishReason.LENGTH)
                    if req.token_ids not in self.history and len(req.token_ids) < 40:
                        self.history.append(list(req.token_ids))

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.abort([rid])

    @rule(num=st.integers(1, NUM_BLOCKS))
    def evict(self, num: int) -> None:
        self.bm.evict(num)

    @rule()
    def settle(self) -> None:
        self.mgr.wait_idle()

    @rule(host=st.booleans(), disk_get=st.booleans(), disk_put=st.booleans())
    def failures(self, host: bool, disk_get: bool, disk_put: bool) -> None:
        self.host.fail_gets = host
        self.disk.fail_gets = disk_get
        self.disk.fail_puts = disk_put

    @invariant()
    def accounting_is_exact(self) -> None:
        self.bm.check_integrity()
        self.host.check_integrity()
        assert self.host.stats().blocks <= 6
        assert len(self.disk.hashes()) <= 9
        stats = self.mgr.stats()
        onboarded_from_disk = self.disk_hits() - self.disk_hits_before
        assert stats.onboarded == self.host.stats().hits + onboarded_from_disk

    @invariant()
    def every_held_block_has_its_hashs_bytes(self) -> None:
        buf = torch.empty(2 * BS, dtype=torch.uint8)
        for h in self.host.hashes():
            assert self.host.peek(h, buf) and bytes(buf.numpy()) == self.truth[h]
        assert all(data == self.truth[h] for h, data in self.disk_blocks().items())
        for block in self.bm._blocks:
            if block.block_hash is not None:
                data = bytes(self.kv[block.block_id].flatten().numpy())
                assert data == self.truth[block.block_hash]

    @invariant()
    def waiting_requests_hold_no_blocks(self) -> None:
        for req in self.sched.waiting:
            assert not self.bm.has_request(req.request_id)


class DiskTierSchedules(TierSchedules):
    """With the real disk tier, which a restart reopens from its directory; only the host
    tier's reads fail on demand (the disk's own failures: test_disk_tier_failures.py)."""

    def open_disk(self) -> DiskTier:  # type: ignore[override]
        self.root = Path(tempfile.mkdtemp(prefix="tiers-prop-"))
        self.own_reads = 0
        return DiskTier(self.root, FP, 2 * BS, 9 * (64 + 2 * BS))

    def reopen_disk(self) -> DiskTier:  # type: ignore[override]
        return DiskTier(self.root, FP, 2 * BS, 9 * (64 + 2 * BS))

    def start(self) -> None:
        self.own_reads = 0
        super().start()

    def disk_hits(self) -> int:
        return self.disk.stats().hits - self.own_reads

    def disk_blocks(self) -> dict[int, bytes]:
        self.mgr.wait_idle()
        buf = torch.empty(2 * BS, dtype=torch.uint8)
        blocks = {}
        for h in self.disk.hashes():
            assert self.disk.get(h, buf), "a block file the tier holds is unreadable"
            self.own_reads += 1
            blocks[h] = bytes(buf.numpy())
        files = list((self.root / FP.digest).iterdir())
        assert len(files) == len(blocks), "a block file without an index entry, or the reverse"
        return blocks

    @rule(host=st.booleans(), disk_get=st.booleans(), disk_put=st.booleans())
    def failures(self, host: bool, disk_get: bool, disk_put: bool) -> None:
        self.host.fail_gets = host

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.root, ignore_errors=True)


TierSchedules.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
test_tier_schedules = TierSchedules.TestCase
DiskTierSchedules.TestCase.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None
)
test_tier_schedules_on_disk = DiskTierSchedules.TestCase
