"""Routing policy: exact decisions for each policy and disaggregation mode."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.policy import KVWeights, NoHealthyWorker, RouteRequest, WorkerState, pick, route
from workers.protocol.block_hashes import hash_prompt_blocks

BS = 4
PROMPT = list(range(40))  # 10 full blocks
REQ = RouteRequest(len(PROMPT), tuple(hash_prompt_blocks(PROMPT, BS)), BS)


def holding(name: str, num_blocks: int, **kw) -> WorkerState:
    """A worker whose cache holds the prompt's first ``num_blocks`` blocks."""
    return WorkerState(name, cached_hashes=frozenset(REQ.block_hashes[:num_blocks]), **kw)


def test_round_robin_cycles_over_healthy_workers_only():
    pool = [WorkerState("a"), WorkerState("b", healthy=False), WorkerState("c")]
    names = [pick("round_robin", pool, REQ, cursor).name for cursor in range(4)]
    assert names == ["a", "c", "a", "c"]


def test_least_loaded_counts_incoming_and_breaks_ties_by_kv_usage():
    pool = [
        WorkerState("a", num_running=1, num_incoming=2),
        WorkerState("b", num_running=1, num_waiting=1, kv_blocks_used=32, kv_blocks_total=64),
        WorkerState("c", num_running=2, kv_blocks_used=8, kv_blocks_total=64),
        WorkerState("d", num_running=2, kv_blocks_used=16, kv_blocks_total=64),
    ]
    assert pick("least_loaded", pool, REQ, 0).name == "c"


def test_exact_ties_go_round_robin_over_the_tied_not_by_name():
    pool = [WorkerState("z", num_running=1, kv_blocks_used=4), WorkerState("b"), WorkerState("a")]
    for policy in ("least_loaded", "kv_aware"):
        names = [pick(policy, pool, REQ, cursor).name for cursor in range(4)]
        assert names == ["b", "a", "b", "a"], policy


def test_kv_aware_prefers_the_cached_prefix_over_a_little_load():
    # c holds 7 of 10 blocks; its 6 blocks in use cost less than the 7 blocks a would
    # prefill again (weight 2: 14).
    pool = [holding("a", 0), holding("b", 7, kv_blocks_used=9), holding("c", 7, kv_blocks_used=6)]
    assert pick("kv_aware", pool, REQ, 0).name == "c"
    # A later block alone does not count: the prefix must be contiguous from the start.
    gap = WorkerState("gap", cached_hashes=frozenset(REQ.block_hashes[1:]))
    assert pick("kv_aware", [gap, holding("one", 1, kv_blocks_used=0)], REQ, 0).name == "one"


def test_kv_aware_counts_prompt_tokens_already_queued_and_the_overlap_weight():
    # b holds the whole prompt but has 12 blocks' worth of prompts to compute first.
    pool = [holding("a", 0), holding("b", 10, num_prefill_tokens=12 * BS)]
    assert pick("kv_aware", pool, REQ, 0).name == "a"
    # a holds the prompt and 15 blocks in use; b would prefill 10 blocks: weighed 1x b is
    # cheaper (10 < 15), weighed 2x a is (15 < 20).
    pool = [holding("a", 10, kv_blocks_used=15), holding("b", 0)]
    weighed = [replace(REQ, weights=KVWeights(overlap_weight=w)) for w in (1.0, 2.0)]
    assert [pick("kv_aware", pool, req, 0).name for req in weighed] == ["b", "a"]


def test_kv_aware_lets_load_win_past_the_balance_threshold():
    cached = holding("cached", 10, num_running=6)
    idle = holding("idle", 0, num_running=1)
    weights = KVWeights(balance_abs_requests=4, balance_rel=1.5)
    assert pick("kv_aware", [cached, idle], replace(REQ, weights=weights), 0).name == "idle"
    # Within the threshold (spread 5, not above 5) the cache wins.
    lenient = KVWeights(balance_abs_requests=5, balance_rel=1.5)
    assert pick("kv_aware", [cached, idle], replace(REQ, weights=lenient), 0).name == "cached"
    # Both tests must hold: 6 is not above 6 x 1.
    strict_rel = KVWeights(balance_abs_requests=4, balance_rel=6.0)
    assert pick("kv_aware", [cached, idle], replace(REQ, weights=strict_rel), 0).name == "cached"


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware"])
@pytest.mark.parametrize("num_workers,num_requests", [(2, 6), (3, 7), (4, 9)])
def test_a_burst_spreads_within_one_across_equal_workers(policy, num_workers, num_requests):
    """N routes with no report in between: each counts against its worker at once (as
    WorkerView does: one more incoming request, its prompt's blocks), so the next sees it."""
    decode = {f"d{i}": WorkerState(f"d{i}", kv_blocks_total=256) for i in range(num_workers)}
    prefill = [WorkerState("p0")]
    cursor, counts = 0, dict.fromkeys(decode, 0)
    for _ in range(num_requests):
        d = route(
            REQ,
            prefill,
            list(decode.values()),
            policy=policy,
            disaggregation="always",
            auto_local_prefill_tokens=0,
            saturated_queue=1,
            cursor=cursor,
        )
        cursor = d.round_robin_cursor
        counts[d.decode] += 1
        w = decode[d.decode]
        decode[d.decode] = replace(
            w, num_incoming=w.num_incoming + 1, kv_blocks_used=w.kv_blocks_used + 10
        )
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_no_healthy_worker_raises():
    with pytest.raises(NoHealthyWorker):
        pick("least_loaded", [WorkerState("a", healthy=False)], REQ, 0)


def decide(disaggregation, prefill, decode, threshold=8, saturated=4):
    return route(
        REQ,
        prefill,
        decode,
        policy="kv_aware",
        disaggregation=disaggregation,
        auto_local_prefill_tokens=threshold,
        saturated_queue=saturated,
    )


def test_auto_prefills_locally_when_the_uncached_part_is_short():
    decode = [holding("d0", 9), WorkerState("d1")]  # d0 holds 36 of 40 tokens
    d = decide("auto", [WorkerState("p0")], decode)
    assert (d.decode, d.prefill, d.cached_tokens) == ("d0", None, 36)


def test_auto_hands_off_a_long_uncached_prompt_to_the_best_prefill_worker():
    prefill = [WorkerState("p0"), holding("p1", 5)]
    d = decide("auto", prefill, [WorkerState("d0")])
    assert (d.decode, d.prefill, d.cached_tokens) == ("d0", "p1", 20)


def test_auto_prefills_locally_when_prefill_is_saturated_or_down():
    busy = [WorkerState("p0", num_waiting=4), WorkerState("p1", num_waiting=9)]
    assert decide("auto", busy, [WorkerState("d0")]).prefill is None
    down = [WorkerState("p0", healthy=False)]
    assert decide("auto", down, [WorkerState("d0")]).prefill is None


def test_always_and_never():
    prefill, decode = [WorkerState("p0")], [holding("d0", 10)]
    assert decide("always", prefill, decode).prefill == "p0"
    assert decide("never", prefill, decode).prefill is None
    with pytest.raises(NoHealthyWorker):
        decide("always", [WorkerState("p0", healthy=False)], decode)
    with pytest.raises(NoHealthyWorker):
        decide("never", prefill, [WorkerState("d0", healthy=False)])


def test_round_robin_with_hand_off_cycles_over_both_pools():
    """One cursor step per request: with 1 prefill and 2 decode workers the decode
    workers alternate (stepping the cursor per pool would pin every request to one)."""
    prefill = [WorkerState("p0")]
    decode = [WorkerState("d0"), WorkerState("d1")]
    cursor, picks = 0, []
    for _ in range(4):
        decision = route(
            REQ,
            prefill,
            decode,
            policy="round_robin",
            disaggregation="always",
            auto_local_prefill_tokens=0,
            saturated_queue=1,
            cursor=cursor,
        )
        cursor = decision.round_robin_cursor
        picks.append((decision.prefill, decision.decode))
    assert picks == [("p0", "d0"), ("p0", "d1"), ("p0", "d0"), ("p0", "d1")]


def test_a_handed_off_request_prefers_the_decode_worker_that_holds_more_of_its_prompt():
    """Under disaggregation a decode worker receives only the blocks it lacks (partial
    receive): each costs ``receive_weight`` of a block to compute, a small tilt that a
    little more load outweighs."""
    weights = KVWeights(overlap_weight=2.0, receive_weight=0.1)
    req = replace(REQ, weights=weights)
    prefill = [WorkerState("p0")]

    def decode_of(*pool: WorkerState) -> str:
        return route(
            req,
            prefill,
            list(pool),
            policy="kv_aware",
            disaggregation="always",
            auto_local_prefill_tokens=0,
            saturated_queue=1,
        ).decode

    # d1 holds 8 of the 10 blocks: it receives 2 (cost 2.0 x 0.1 x 2 = 0.4), d0 all 10
    # (2.0); d0 first, so an exact tie would pick it.
    assert decode_of(WorkerState("d0"), holding("d1", 8)) == "d1"
    # The saving (1.6) outweighs one more KV block in use on d1, not two.
    assert decode_of(WorkerState("d0"), holding("d1", 8, kv_blocks_used=1)) == "d1"
    assert decode_of(WorkerState("d0"), holding("d1", 8, kv_blocks_used=2)) == "d0"
    # Both hold some: the one that holds more receives less.
    assert decode_of(holding("d0", 3), holding("d1", 5)) == "d1"


def test_receive_weight_zero_ignores_a_fed_decode_workers_pool():
    req = replace(REQ, weights=KVWeights(receive_weight=0.0))
    pool = [WorkerState("d0"), holding("d1", 10)]
    # Equal cost: an exact tie, round robin by the cursor, as before partial receive.
    assert [pick("kv_aware", pool, req, c, prefills=False).name for c in (0, 1)] == ["d0", "d1"]
    # When the decode worker prefills itself, its cache counts in full whatever the weight.
    assert pick("kv_aware", pool, req, 0, prefills=True).name == "d1"
