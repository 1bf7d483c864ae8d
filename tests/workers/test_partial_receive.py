"""A decode engine that holds the start of a prompt's KV receives only the rest, over NIXL.

Real tiny model, real NIXL agents (one prefill and one decode connector in this process).
The decode engine computed a shared prefix itself first (an earlier turn); the handed-off
requests then share those blocks and pull P's blocks after them. What must hold: the
tokens of one aggregated engine, fewer blocks and bytes transferred (counted), the shared
blocks never written, a failed receive recomputed from the prefix on (not from 0), an
abort while receiving frees everything but the cached prefix, and P's leases all end.
"""

from __future__ import annotations

import random

import nixl  # noqa: F401  (required: the connectors' NIXL agents; a broken install fails)
import pytest
import torch

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, create_connector
from workers.engine.llm_engine import LLMEngine
from workers.engine.request import FinishReason

from .test_engine_roles import (
    BS,
    GREEDY,
    aggregated,
    assert_no_blocks_in_use,
    make_engine,
    prefill,
    tokens,
)

SHARED = 3  # prompt blocks the decode engine holds before the hand-off


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("partial")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return str(path)


@pytest.fixture(scope="module")
def shared_prompts():
    """(shared prefix, prompts): three continue the prefix, one does not."""
    rng = random.Random(11)
    shared = [rng.randrange(1000) for _ in range(SHARED * BS)]
    tails = [[rng.randrange(1000) for _ in range(n)] for n in (1, 8, 13)]
    other = [rng.randrange(1000) for _ in range(20)]
    return shared, [shared + tail for tail in tails] + [other]


class Pair:
    """A prefill and a decode engine with connected NIXL connectors."""

    def __init__(self, model_dir: str, direction: str = "pull", **decode_settings):
        self.p, self.d = make_engine(model_dir), make_engine(model_dir, **decode_settings)
        self.released: list[str] = []
        self.p_conn = self._connector(self.p, "prefill", self.released.append, direction)
        self.d_conn = self._connector(self.d, "decode", lambda rid: None, direction)
        self.d_conn.add_peer(self.p_conn.metadata())
        self.p_conn.add_peer(self.d_conn.metadata())
        self.block_bytes = self.d_conn.layout.block_bytes

    @staticmethod
    def _connector(engine: LLMEngine, name: str, on_release, direction: str):
        layout = KVLayout.from_tensor(engine.kv_cache, model_id="tiny", num_kv_heads=2)
        config = KVTransferConfig(
            backend="nixl", direction=direction, transfer_timeout_s=20, lease_seconds=60
        )
        return create_connector(
            config, layout, engine.kv_cache, name, lambda rid, why: on_release(rid)
        )

    def hand_off(self, prompts, params):
        """Prefill, offer, and admit on D; returns {request_id: handle}."""
        held = prefill(self.p, prompts, params)
        handles = {}
        for h, prompt, sp in zip(held, prompts, params, strict=True):
            handles[h.request_id] = self.p_conn.offer(
                h.request_id,
                list(h.held_block_ids),
                num_tokens=len(prompt),
                first_token_id=h.token_ids[0],
            )
            self.d.add_request(prompt, sp, h.request_id, remote_first_token=h.token_ids[0])
        return held, handles

    def wait_released(self, n: int) -> None:
        for _ in range(2000):
            if len(self.released) >= n:
                break
            self.p_conn.sync()
        assert len(self.released) == n
        for rid in self.released:
            self.p.release_held(rid)  # the worker's on_release frees the held blocks

    def close(self) -> None:
        self.p_conn.close()
        self.d_conn.close()


def warm(d: LLMEngine, shared: list[int]) -> tuple[int, ...]:
    """D computes a request on the shared prefix itself; returns the prefix's blocks."""
    aggregated(d, [[*shared, 7]], [GREEDY])
    hit = d.block_manager.find_prefix([*shared, 7])
    assert hit.num_blocks == SHARED
    return hit.block_ids


@pytest.mark.parametrize(
    ("where", "direction"), [("pool", "pull"), ("pool", "push"), ("host_tier", "pull")]
)
def test_decode_holding_a_prefix_receives_only_the_rest_and_gives_the_same_tokens(
    model_dir, shared_prompts, where, direction
):
    """D holds the prefix in its pool (shared blocks), or only in its host tier (G2:
    onboarded into fresh blocks, not received); D pulls the rest, or P pushes it."""
    shared, prompts = shared_prompts
    params = [GREEDY] * len(prompts)
    agg = make_engine(model_dir)
    want = [tokens(deltas) for deltas in aggregated(agg, prompts, params)]
    assert all(len(set(w)) > 3 for w in want)  # not degenerate
    tier = {"kv_host_tier_gib": 1 / 1024} if where == "host_tier" else {}
    pair = Pair(model_dir, direction, **tier)
    d = pair.d
    try:
        shared_blocks = warm(d, shared)
        if where == "host_tier":
            assert d.block_manager.evict() > 0  # the pool forgets it; G2 keeps it
            assert d.block_manager.find_prefix([*shared, 7]).num_blocks == 0
        before = d.kv_cache[list(shared_blocks)].clone()
        held, handles = pair.hand_off(prompts, params)
        out: dict[str, list] = {}
        first_blocks, received_blocks, received_bytes = {}, 0, 0
        while d.has_unfinished_requests():
            for delta in d.step():
                out.setdefault(delta.request_id, []).append(delta)
            for receive in d.take_kv_receives():
                rid = receive.request_id
                table = d.block_manager.block_table(rid)
                if where == "pool":
                    assert (
                        table[: receive.first_block] == list(shared_blocks)[: receive.first_block]
                    )
                handle = handles[rid].from_block(receive.first_block)
                result = pair.d_conn.receive([handle], list(receive.block_ids)).result(30)
                assert result.direction == direction
                first_blocks[rid] = receive.first_block
                received_blocks += len(receive.block_ids)
                received_bytes += result.num_bytes
                d.kv_received(rid, ok=True)
        for h, w in zip(held, want, strict=True):
            assert [h.token_ids[0], *tokens(out[h.request_id])] == w
        # Three prompts continue the prefix D holds; the last one shares nothing.
        assert [first_blocks[h.request_id] for h in held] == [SHARED] * 3 + [0]
        all_blocks = sum(-(-len(p) // BS) for p in prompts)
        assert received_blocks == all_blocks - 3 * SHARED == d.handoff.num_receive_blocks
        assert d.handoff.num_reused_blocks == 3 * SHARED
        assert received_bytes == received_blocks * pair.block_bytes
        if where == "pool":
            assert torch.equal(d.kv_cache[list(shared_blocks)], before)  # never written
        else:  # onboarded once, then shared from the pool by the other two
            assert d.kv_tiers.stats().onboarded == SHARED
        pair.wait_released(len(prompts))
    finally:
        pair.close()
    assert_no_blocks_in_use(agg, pair.p, d)


def test_failed_partial_receive_recomputes_from_the_prefix_and_abort_leaks_nothing(
    model_dir, shared_prompts
):
    shared, prompts = shared_prompts
    prompts = prompts[1:3]  # both continue the shared prefix
    params = [GREEDY] * len(prompts)
    want = [tokens(deltas) for deltas in aggregated(make_engine(model_dir), prompts, params)]
    pair = Pair(model_dir)
    d = pair.d
    try:
        shared_blocks = warm(d, shared)
        before = d.kv_cache[list(shared_blocks)].clone()
        (failed, aborted), handles = pair.hand_off(prompts, params)
        assert d.step() == []  # both admitted into RECEIVING
        receives = {r.request_id: r for r in d.take_kv_receives()}
        assert {r.first_block for r in receives.values()} == {SHARED}

        # The transfer fails: nothing read (P is told), the prompt recomputed after the prefix.
        pair.d_conn.decline([handles[failed.request_id]], "aborted")
        d.kv_received(failed.request_id, ok=False)
        req = d.scheduler.requests[failed.request_id]
        assert req.num_computed_tokens == SHARED * BS  # not 0: the prefix stays computed

        # Aborted while its (real) transfer runs: blocks kept until it ended, then freed.
        rid = aborted.request_id
        handle = handles[rid].from_block(SHARED)
        future = pair.d_conn.receive([handle], list(receives[rid].block_ids))
        d.abort_request(rid)
        assert d.block_manager.block_table(rid)  # still the transfer's target
        future.result(30)
        d.kv_received(rid, ok=True)
        out: dict[str, list] = {}
        while d.has_unfinished_requests():
            for delta in d.step():
                out.setdefault(delta.request_id, []).append(delta)
        assert [failed.token_ids[0], *tokens(out[failed.request_id])] == want[0]
        assert out[rid][-1].finish_reason is FinishReason.ABORT
        assert torch.equal(d.kv_cache[list(shared_blocks)], before)
        # The prefix and the recomputed blocks stay cached; nothing is in use.
        assert d.block_manager.find_prefix([*shared, 7]).block_ids == shared_blocks
        pair.wait_released(2)
    finally:
        pair.close()
    assert_no_blocks_in_use(pair.p, d)
