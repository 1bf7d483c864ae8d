"""Block manager: exact ids and eviction order, and a model-checked state machine.

The state machine keeps a shadow of what each block *contains* (the tokens the
runner would have written), so a prefix hit on the wrong block, a block reused
while still in use, or a missed copy-on-write fails here, not only accounting.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.engine.block_manager import BlockManager
from workers.protocol.block_hashes import hash_prompt_blocks

BS = 4


def test_exact_ids_prefix_hit_and_eviction_order():
    bm = BlockManager(num_blocks=6, block_size=BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    assert bm.allocate_slots("a", 0, 10)
    assert bm.block_table("a") == [0, 1, 2]
    bm.commit_computed("a", tokens, 10)
    bm.free("a")
    bm.check_integrity()
    # tail released first: block 2 (unhashed) -> free list; then 1, 0 -> cached in that order
    assert bm.num_cached_blocks == 2 and bm.num_used_blocks == 0

    hit = bm.find_prefix([*range(8), 99, 98])
    assert hit.block_ids == (0, 1)
    assert bm.allocate_slots("b", 8, 2, hit)
    assert bm.block_table("b") == [0, 1, 3]  # free list order: 3, 4, 5, 2
    bm.check_integrity()
    bm.free("b")

    # Fill the cache with unrelated blocks: the free list (4 blocks) goes first, then
    # the LRU cached blocks, the request's tail (1) before its head (0).
    assert bm.allocate_slots("c", 0, 4 * BS)
    assert bm.num_evictions == 0
    assert bm.allocate_slots("d", 0, 1)
    assert bm.block_table("d") == [1]
    assert bm.find_prefix(tokens).block_ids == (0,)
    assert bm.allocate_slots("e", 0, 1)
    assert bm.block_table("e") == [0]
    assert bm.num_evictions == 2
    assert not bm.allocate_slots("f", 0, 1)  # full: refused, nothing changed
    assert not bm.has_request("f")
    bm.check_integrity()


def test_freed_blocks_come_back_as_ascending_runs():
    # Consecutive ids merge into one region in a KV transfer: a request allocated after
    # another one finished must get them in ascending order, not reversed.
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    assert bm.allocate_slots("a", 0, 4 * BS)
    bm.free("a")
    assert bm.allocate_slots("b", 0, 4 * BS)
    assert bm.block_table("b") == [0, 1, 2, 3]


def test_prefix_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = list(range(8))
    assert bm.allocate_slots("a", 0, 8)
    bm.commit_computed("a", tokens, 8)
    # The same 8 tokens again: only the first block may be reused (the model must run
    # the last prompt token to produce logits).
    assert bm.find_prefix(tokens).num_blocks == 1
    assert bm.find_prefix([*tokens, 1]).num_blocks == 2


def test_refused_allocation_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    assert bm.allocate_slots("a", 0, 8)
    bm.commit_computed("a", list(range(8)), 8)
    bm.free("a")  # blocks 0,1 cached, block 2 free
    hit = bm.find_prefix([*range(8), 5])
    assert hit.num_blocks == 2
    # Reviving both cached blocks leaves one free block: 3 more blocks cannot fit.
    assert not bm.allocate_slots("b", 8, 13, hit)
    bm.check_integrity()
    assert bm.num_cached_blocks == 2
    assert bm.allocate_slots("b", 8, 4, hit)
    bm.check_integrity()


def test_fork_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate_slots("p", 0, 6)
    bm.commit_computed("p", list(range(6)), 6)
    bm.fork("p", "c")
    assert bm.block_table("c") == [0, 1]
    # The child writes position 6, inside shared partial block 1: it gets a private copy.
    assert bm.allocate_slots("c", 6, 1)
    assert bm.block_table("c") == [0, 2]
    assert bm.take_copies() == [(1, 2)]
    # The parent now owns block 1 alone: no copy.
    assert bm.allocate_slots("p", 6, 1)
    assert bm.block_table("p") == [0, 1]
    assert bm.take_copies() == []
    bm.check_integrity()
    bm.free("p")
    bm.free("c")
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_hashes_are_chained_and_stable():
    a = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_prompt_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[1] != b[1]  # same block tokens, different prefix
    assert hash_prompt_blocks([1, 2, 3, 4], BS) == a[:1]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=BS)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        # A slot's KV depends on its token *and every token before it*: the shadow stores
        # the whole prefix, so reusing a block under a different prefix is caught.
        self.memory: dict[int, list[tuple[int, ...] | None]] = {}
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _write(self, req_id: str, start: int, end: int) -> None:
        """What the runner does after a successful allocation: copies, then the step's KV."""
        for src, dst in self.bm.take_copies():
            self.memory[dst] = list(self.memory.get(src, [None] * BS))
        table = self.bm.block_table(req_id)
        for pos in range(start, end):
            block = self.memory.setdefault(table[pos // BS], [None] * BS)
            block[pos % BS] = tuple(self.tokens[req_id][: pos + 1])
        self.computed[req_id] = end
        self.bm.commit_computed(req_id, self.tokens[req_id], end)

    def _drop(self, req_id: str) -> None:
        self.bm.free(req_id)
        del self.tokens[req_id], self.computed[req_id]

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=22),
        chunk=st.integers(1, 24),
    )
    def admit(self, tokens: list[int], chunk: int) -> None:
        hit = self.bm.find_prefix(tokens)
        for i, block_id in enumerate(hit.block_ids):
            expected = [tuple(tokens[: i * BS + j + 1]) for j in range(BS)]
            assert self.memory[block_id] == expected, "wrong prefix hit"
        cached = hit.num_blocks * BS
        num_new = min(len(tokens) - cached, chunk)
        req_id = self._new_id()
        if self.bm.allocate_slots(req_id, cached, num_new, hit):
            self.tokens[req_id] = list(tokens)
            self._write(req_id, cached, cached + num_new)
        else:
            assert not self.bm.has_request(req_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_token=st.integers(0, 2))
    def step(self, data: st.DataObject, new_token: int) -> None:
        """Continue a prefill chunk, or decode one token; preempt (free) when out of blocks."""
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        start = self.computed[req_id]
        if start == len(self.tokens[req_id]):
            self.tokens[req_id].append(new_token)
        end = len(self.tokens[req_id])
        if self.bm.allocate_slots(req_id, start, end - start):
            self._write(req_id, start, end)
        else:
            self._drop(req_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent][: self.computed[parent]])
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        self._drop(data.draw(st.sampled_from(sorted(self.tokens))))

    @rule(num=st.integers(0, 4))
    def evict(self, num: int) -> None:
        before = self.bm.num_cached_blocks
        assert self.bm.evict(num) == min(num, before)

    @invariant()
    def accounting_balances(self) -> None:
        self.bm.check_integrity()
        in_use = {b for t in (self.bm.block_table(r) for r in self.tokens) for b in t}
        assert self.bm.num_used_blocks == len(in_use)

    @invariant()
    def contents_match_tokens(self) -> None:
        for req_id, tokens in self.tokens.items():
            table = self.bm.block_table(req_id)
            for pos in range(self.computed[req_id]):
                slot = self.memory[table[pos // BS]][pos % BS]
                assert slot == tuple(tokens[: pos + 1]), (req_id, pos)

    def teardown(self) -> None:
        for req_id in list(self.tokens):
            self._drop(req_id)
        self.bm.check_integrity()
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("enable", [False])
def test_prefix_caching_off_never_hits(enable: bool):
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=enable)
    assert bm.allocate_slots("a", 0, 8)
    bm.commit_computed("a", list(range(8)), 8)
    bm.free("a")
    assert bm.find_prefix([*range(8), 1]).num_blocks == 0
    assert bm.num_cached_blocks == 0
    bm.check_integrity()
