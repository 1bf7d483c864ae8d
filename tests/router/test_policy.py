"""Routing policy: exact decisions for each policy and disaggregation mode."""

from __future__ import annotations

import pytest

from router.policy import NoHealthyWorker, RouteRequest, WorkerState, pick, route
from workers.protocol.block_hashes import hash_prompt_blocks

BS = 4
PROMPT = list(range(40))  # 10 full blocks
REQ = RouteRequest(len(PROMPT), tuple(hash_prompt_blocks(PROMPT, BS)), BS)


def holding(name: str, num_blocks: int, **kw) -> WorkerState:
    """A worker whose cache holds the prompt's first ``num_blocks`` blocks."""
    return WorkerState(name, cached_hashes=frozenset(REQ.block_hashes[:num_blocks]), **kw)


def test_round_robin_cycles_over_healthy_workers_only():
    pool = [WorkerState("a"), WorkerState("b", healthy=False), WorkerState("c")]
    cursor, names = 0, []
    for _ in range(4):
        worker, cursor = pick("round_robin", pool, REQ, cursor)
        names.append(worker.name)
    assert names == ["a", "c", "a", "c"]


def test_least_loaded_breaks_ties_by_kv_usage_then_name():
    pool = [
        WorkerState("a", num_running=3),
        WorkerState("b", num_running=1, num_waiting=1, kv_usage=0.5),
        WorkerState("c", num_running=2, kv_usage=0.2),
        WorkerState("d", num_running=2, kv_usage=0.2),
    ]
    assert pick("least_loaded", pool, REQ, 0)[0].name == "c"


def test_kv_aware_prefers_longest_cached_prefix_then_load():
    pool = [holding("a", 3), holding("b", 7, num_running=5), holding("c", 7, num_running=1)]
    assert pick("kv_aware", pool, REQ, 0)[0].name == "c"
    # A later block alone does not count: the prefix must be contiguous from the start.
    gap = WorkerState("gap", cached_hashes=frozenset(REQ.block_hashes[1:]))
    assert pick("kv_aware", [gap, holding("one", 1, num_running=9)], REQ, 0)[0].name == "one"


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
