"""Pools that share cores slow each other (cluster/planner/busy.py): the busy timeline's
shares, the step fits' overlap term, the two-pass simulation, and the feed's overlap of
each record read off real ``OutputBatch``es."""

from __future__ import annotations

import pytest

from cluster.planner.busy import BusyTimeline
from cluster.planner.simulator import PoolLimits, SimRequest, simulate
from cluster.planner.step_model import DecodeStep, PrefillStep, StepModel
from cluster.planner_feed import LoadFeed
from tests.cluster.test_planner_loop import Clock, FakeClient, FakeView, batch
from workers.protocol.wire import TokenEvent


def test_busy_timeline_merges_intervals_and_gives_the_covered_share():
    busy = BusyTimeline([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (5.0, 5.0)])  # [0, 2] and [3, 4]
    assert busy.share(0.0, 2.0) == 1.0
    assert busy.share(1.0, 3.0) == pytest.approx(0.5)
    assert busy.share(1.5, 3.5) == pytest.approx(0.5)  # 0.5 of [1.5, 2] + 0.5 of [3, 3.5]
    assert busy.share(4.0, 6.0) == 0.0
    assert busy.share(-1.0, 5.0) == pytest.approx(3.0 / 6.0)
    assert busy.share(2.0, 2.0) == 0.0
    assert BusyTimeline([]).share(0.0, 1.0) == 0.0


def _records(interference_s: float) -> StepModel:
    """Decode steps of 10 ms + 1 ms per sequence, ``interference_s`` more when prefill ran
    through them; prefill steps of 20 ms + 0.5 ms per token, the same when decode ran."""
    model = StepModel(warmup_steps=0)
    for i in range(60):
        overlap = (i % 5) / 4  # 0, 0.25, ... 1
        tokens = 64 + 13 * i
        seconds = 0.020 + 0.0005 * tokens + interference_s * overlap
        model.observe(PrefillStep("p0", seconds, tokens, 0.0, overlap=overlap))
        batch_size = 1 + i % 8
        seconds = 0.010 + 0.001 * batch_size + interference_s * overlap
        model.observe(DecodeStep("d0", seconds, batch_size, 1000, overlap=overlap))
    return model


def test_the_fits_learn_the_interference_and_the_simulation_applies_it():
    shared, separate = _records(0.008), _records(0.0)
    assert shared.decode.coefficients()[3] == pytest.approx(0.008, rel=1e-3)
    assert shared.prefill.coefficients()[3] == pytest.approx(0.008, rel=1e-3)
    assert shared.has_interference and not separate.has_interference
    assert shared.decode_seconds(4, 1000, overlap=1.0) == pytest.approx(0.014 + 0.008, rel=1e-3)
    # Requests whose prefills fall while others decode: the shared pools' ITL is longer,
    # and only where prefill ran (a lone request's decode overlaps no prefill).
    requests = tuple(SimRequest(0.2 * i, 400, 30) for i in range(40))
    limits = PoolLimits(max_batched_tokens=256)
    crowded_shared = simulate(requests, 1, 1, shared, limits)
    crowded_separate = simulate(requests, 1, 1, separate, limits)
    assert crowded_shared.itl_p90 > crowded_separate.itl_p90 + 0.004
    assert crowded_shared.ttft_p90 > crowded_separate.ttft_p90
    lone = (SimRequest(0.0, 100, 20),)
    assert simulate(lone, 1, 1, shared, limits).itl_s == pytest.approx(
        simulate(lone, 1, 1, separate, limits).itl_s, rel=1e-6
    )
    assert simulate(requests, 1, 1, shared, limits) == crowded_shared  # deterministic


def test_the_feed_gives_each_record_the_share_the_other_pool_computed():
    clock = Clock()
    feed = LoadFeed(10.0, clock)
    prefill = FakeView(FakeClient("prefill-0", "prefill"))
    decode = FakeView(FakeClient("decode-0", "decode"))

    def prefilled(request_id: str) -> None:
        event = TokenEvent(request_id, (7,), False, None, None, 100, 0, kv_handles=(b"h",))
        feed.batch(prefill, batch("prefill-0", "prefill", event))

    clock.now = 100.0
    feed.arrived("r1", 100)
    clock.now = 100.3
    prefilled("r1")  # prefill [100.0, 100.3]
    clock.now = 100.32
    feed.arrived("r2", 100)
    clock.now = 100.4
    feed.batch(decode, batch("decode-0", "decode", TokenEvent("r1", (8,), False)))  # [100.3, .4]
    clock.now = 100.45
    feed.batch(decode, batch("decode-0", "decode", TokenEvent("r1", (9,), False)))  # [.4, .45]
    clock.now = 100.5
    prefilled("r2")  # prefill [100.32, 100.5]: the decode steps ran through 0.13 s of it
    steps = feed.take(101.0).steps
    by_end = {round(s.end_s, 2): s for s in steps}
    assert by_end[100.3].overlap == 0.0  # nothing decoded yet
    assert by_end[100.4].overlap == pytest.approx(0.08 / 0.1)
    assert by_end[100.45].overlap == pytest.approx(1.0)
    assert by_end[100.5].overlap == pytest.approx(0.13 / 0.18)
