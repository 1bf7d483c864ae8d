"""The SLA planner's core as pure functions (cluster/planner/): the step-time fits, the pool
simulation, and the policy's rules (no reversal at constant load, replicas monotone in load,
never below the minimums, manual changes respected, reaction to a load step, warm-up records
left out)."""

from __future__ import annotations

import itertools
import random

import pytest

from cluster.planner.forecast import RateForecast, plan_rate
from cluster.planner.policy import Observation, Planner, PlannerConfig
from cluster.planner.simulator import PoolLimits, SimRequest, percentile, simulate
from cluster.planner.step_model import DecodeStep, OnlineFit, PrefillStep, StepModel

# A machine where a prefill step costs 20 ms + 0.5 ms per token and a decode step
# 10 ms + 1 ms per sequence + 0.2 ms per thousand KV tokens.
PREFILL = (0.020, 0.0005, 0.0)
DECODE = (0.010, 0.001, 0.0002)


def trained_model(warmup_steps: int = 0) -> StepModel:
    model = StepModel(warmup_steps=warmup_steps)
    for i in range(40):
        tokens, work = 64 + 37 * i, 0.0
        model.observe(PrefillStep("p0", PREFILL[0] + PREFILL[1] * tokens, tokens, work))
        batch, kv = 1 + i % 16, 500 * (1 + i)
        seconds = DECODE[0] + DECODE[1] * batch + DECODE[2] * kv / 1000
        model.observe(DecodeStep("d0", seconds, batch, kv))
    return model


def workload(rate: float, seconds: float, prompt: int = 200, output: int = 20, start=0.0):
    count = int(rate * seconds)
    return tuple(SimRequest(start + i / rate, prompt, output) for i in range(count))


def test_online_fit_recovers_coefficients_and_forgets_old_ones():
    fit = OnlineFit(2, forgetting=0.9)
    for x in range(50):
        fit.add((1.0, float(x)), 3.0 + 2.0 * x)
    assert fit.coefficients() == pytest.approx((3.0, 2.0), rel=1e-6)
    for x in range(200):  # the machine changed: the fit follows
        fit.add((1.0, float(x % 50)), 1.0 + 4.0 * (x % 50))
    assert fit.coefficients() == pytest.approx((1.0, 4.0), rel=1e-4)


def test_a_new_workers_warmup_steps_are_left_out():
    model = StepModel(warmup_steps=3)
    slow = [PrefillStep("new", 5.0, 100, 0.0) for _ in range(3)]
    assert [model.observe(step) for step in slow] == [False, False, False]
    assert model.observe(PrefillStep("new", 0.07, 100, 0.0)) is True
    assert model.prefill.num_records == 1
    model.forget_worker("new")
    assert model.observe(PrefillStep("new", 5.0, 100, 0.0)) is False


def test_simulation_queues_under_load_and_a_second_worker_helps():
    model = trained_model()
    service = PREFILL[0] + PREFILL[1] * 200  # 0.12 s per 200-token prompt alone
    sparse = simulate(workload(1.0, 30), 1, 1, model, PoolLimits(max_batched_tokens=256))
    assert sparse.ttft_p90 == pytest.approx(service, rel=0.01)
    busy = simulate(workload(9.0, 30), 1, 1, model, PoolLimits(max_batched_tokens=256))
    two = simulate(workload(9.0, 30), 2, 1, model, PoolLimits(max_batched_tokens=256))
    assert busy.ttft_p90 > 3 * service  # 9/s x 0.12 s > 1: the queue grows
    assert two.ttft_p90 < busy.ttft_p90 / 3
    # decode: every token of a lone sequence costs one single-sequence step
    assert len(sparse.itl_s) == 30 * 19
    assert max(sparse.itl_s) == pytest.approx(DECODE[0] + DECODE[1] + DECODE[2] * 0.22, 0.05)
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9) == 9


def test_long_prompts_span_chunks():
    model = trained_model()
    limits = PoolLimits(max_batched_tokens=100)
    result = simulate((SimRequest(0.0, 250, 2),), 1, 1, model, limits)
    steps = 3 * PREFILL[0] + PREFILL[1] * 250  # 100 + 100 + 50 tokens
    assert result.ttft_s[0] == pytest.approx(steps, rel=1e-3)


def _planner(**overrides) -> Planner:
    config = PlannerConfig(ttft_p90_ms=400, itl_p90_ms=60, max_workers=8, cooldown_s=30,
                           limits=PoolLimits(max_batched_tokens=256), **overrides)  # fmt: skip
    return Planner(config, trained_model())


def _run(planner: Planner, rates: list[float], window: float = 10.0, start=(1, 1)):
    sizes, decisions = start, []
    for tick, rate in enumerate(rates):
        obs = Observation(
            tick * window, *sizes, window, workload(rate, window, start=tick * window)
        )
        decision = planner.tick(obs)
        decisions.append(decision)
        sizes = (decision.prefill, decision.decode)
    return decisions


def test_constant_load_never_reverses():
    decisions = _run(_planner(), [12.0] * 30)
    prefill = [d.prefill for d in decisions]
    ups = [i for i in range(1, 30) if prefill[i] > prefill[i - 1]]
    downs = [i for i in range(1, 30) if prefill[i] < prefill[i - 1]]
    assert not (ups and downs and min(downs) > min(ups)), prefill
    # 12/s of 200-token prompts passes one worker's ~8.6/s (256-token steps of 0.148 s)
    assert prefill[-1] >= 2
    assert len({(d.prefill, d.decode) for d in decisions[2:]}) == 1  # settled, then held


def test_replicas_are_monotone_in_load_and_never_below_the_minimums():
    sizes = []
    for rate in (0.5, 2.0, 5.0, 9.0, 14.0):
        decision = _run(_planner(), [rate] * 3)[-1]
        sizes.append((decision.prefill, decision.decode))
        assert decision.prefill >= 1 and decision.decode >= 1
        assert decision.prefill + decision.decode <= 8
    assert [p for p, _ in sizes] == sorted(p for p, _ in sizes)
    assert sizes[0] == (1, 1) and sizes[-1][0] > sizes[0][0]


def test_reacts_within_two_ticks_of_a_load_step_and_shrinks_after_the_cooldown():
    decisions = _run(_planner(), [1.0] * 4 + [9.0] * 6 + [1.0] * 12)
    assert decisions[3].prefill == 1
    assert max(d.prefill for d in decisions[4:6]) >= 2  # the step at tick 4
    peak = max(d.prefill for d in decisions)
    assert decisions[-1].prefill < peak  # quiet again: shrunk, one at a time
    prefill = [d.prefill for d in decisions]
    assert all(b >= a - 1 for a, b in itertools.pairwise(prefill))
    assert all(d.reason for d in decisions)


def test_a_manual_change_wins():
    planner = _planner()
    first = planner.tick(Observation(0.0, 1, 1, 10.0, workload(1.0, 10)))
    assert (first.prefill, first.decode) == (1, 1)
    # an operator sets 4 prefill workers at a load one handles: held through the cooldown
    held = planner.tick(Observation(10.0, 4, 1, 10.0, workload(1.0, 10, start=10)))
    assert (held.prefill, held.reason) == (4, "hold: manual change respected")
    later = planner.tick(Observation(20.0, 4, 1, 10.0, workload(1.0, 10, start=20)))
    assert later.prefill == 4
    after = planner.tick(Observation(45.0, 4, 1, 10.0, workload(1.0, 10, start=45)))
    assert after.prefill == 3 and "scale down" in after.reason


def test_no_decision_before_the_fits_have_records_and_bad_configs_refused():
    planner = Planner(PlannerConfig(), StepModel())
    decision = planner.tick(Observation(0.0, 2, 3, 10.0, workload(5.0, 10)))
    assert (decision.prefill, decision.decode, decision.is_change) == (2, 3, False)
    with pytest.raises(ValueError, match="max_workers \\(1\\) is below"):
        PlannerConfig(max_workers=1)


def _golden_trace() -> list[SimRequest]:
    """Two minutes of Poisson arrivals with a step in the middle and a bimodal prompt mix."""
    rng = random.Random(38)
    t, out = 0.0, []
    while t < 120.0:
        t += rng.expovariate(3.0 if 40 <= t < 80 else 1.5)
        prompt = rng.randint(600, 1500) if rng.random() < 0.2 else rng.randint(20, 300)
        out.append(SimRequest(t, prompt, rng.randint(1, 60)))
    return out


def test_the_fast_simulation_gives_the_per_token_versions_figures_exactly():
    # Figures of the simulator before its speed-up (a per-token loop, the fit solved at
    # every step), to the last bit: the speed-up changed how, not what, it computes.
    model = StepModel(warmup_steps=0)
    for i in range(40):
        tokens = 64 + 37 * i
        seconds = 0.020 + 0.0005 * tokens + 0.00001 * tokens * tokens / 1000
        model.observe(PrefillStep("p0", seconds, tokens, tokens * tokens / 1000))
        batch, kv = 1 + i % 16, 500 * (1 + i)
        model.observe(DecodeStep("d0", 0.010 + 0.001 * batch + 0.0002 * kv / 1000, batch, kv))
    limits = PoolLimits(max_batched_tokens=512, max_num_seqs=8)
    requests = _golden_trace()
    golden = {  # pools: (sum of TTFTs, sum of ITLs, p90 TTFT, p90 ITL)
        (1, 1): (81.275445043358, 81.98761858698035, 0.8427916903544883, 0.01336939997132217),
        (2, 1): (46.80461985916531, 80.94305198652478, 0.5946697036614488, 0.013242799969826734),
        (1, 2): (81.275445043358, 77.2350027848598, 0.8427916903544883, 0.012189599969535458),
        (3, 3): (43.8161011318144, 76.24735078405521, 0.587226099547081, 0.011249599970581335),
    }
    for pools, expected in golden.items():
        result = simulate(requests, *pools, model, limits)
        assert len(result.itl_s) == 6860
        assert (sum(result.ttft_s), sum(result.itl_s), result.ttft_p90, result.itl_p90) == expected


def test_plan_rate_covers_a_step_and_a_windows_spread():
    forecast = RateForecast()
    for _ in range(5):
        forecast.update(1.0, 10.0)
    assert not forecast.update(1.5, 10.0) > 1.5  # 15 arrivals where 10 were due: noise
    assert not forecast.is_step
    after_step = forecast.update(5.0, 10.0)  # 50 where ~10 were due: a step
    assert forecast.is_step and after_step == 5.0  # sized for at once, no lag, no trend
    # the band: one window's Poisson spread plus the new level's, from one window
    assert plan_rate(after_step, 10.0, 1.0, 1) == pytest.approx(5.0 + (2 * 5.0 / 10.0) ** 0.5)
    assert plan_rate(3.0, 10.0, 0.0) == 3.0
    assert plan_rate(0.0, 10.0, 1.0) == 0.0
    without_window = RateForecast()
    without_window.update(1.0)
    assert without_window.update(5.0) < 5.0 and not without_window.is_step  # no count: no test


def test_a_busy_window_among_quiet_ones_keeps_the_pool_up():
    # Load that alternates around the 1-vs-2 prefill threshold: one scale-up, then held
    # (each of the last down_windows windows must fit the smaller pool), never flapping.
    rates = [2.0] * 2 + [11.0, 6.0, 6.0, 11.0, 6.0, 6.0] * 4
    decisions = _run(_planner(), rates)
    prefill = [d.prefill for d in decisions]
    assert max(prefill) >= 2
    first_up = next(i for i, p in enumerate(prefill) if p >= 2)
    assert all(p >= 2 for p in prefill[first_up:]), prefill


def test_a_large_deficit_is_met_in_one_step_of_several_replicas():
    decisions = _run(_planner(), [1.0] * 3 + [30.0] * 2)
    assert decisions[2].prefill == 1
    assert decisions[3].prefill >= 3  # one decision, not one replica a tick
    assert "scale up" in decisions[3].reason


def test_the_steps_spread_sets_the_p90_and_the_replay_stays_deterministic():
    # Decode steps of 10 ms, one in five 25 ms (another thread's step): the mean fit alone
    # predicts about their mean at a p90 ITL; replaying the recorded ratios gives the slow
    # steps' 25.
    def fed(spread_records: int) -> StepModel:
        model = StepModel(warmup_steps=0, spread_records=spread_records)
        for i in range(200):
            model.observe(PrefillStep("p0", 0.02 + 0.0005 * (64 + i), 64 + i, 0.0))
            model.observe(DecodeStep("d0", 0.025 if i % 5 == 0 else 0.010, 1 + i % 4, 100))
        return model

    spread, mean = fed(100), fed(0)
    assert mean.decode.spread() == () and len(spread.decode.spread()) == 100
    ratios = spread.decode.spread()
    assert ratios == tuple(sorted(ratios)) and 1.9 < ratios[-1] < 2.1
    requests = workload(1.0, 30, prompt=100, output=40)
    with_spread = simulate(requests, 1, 1, spread)
    assert simulate(requests, 1, 1, mean).itl_p90 < 0.017
    assert with_spread.itl_p90 == pytest.approx(0.025, rel=0.15)
    assert simulate(requests, 1, 1, spread) == with_spread  # the same figures every time


def poisson_windows(rate: float, num: int, window: float, seed: int, mix=((1.0, 200),)):
    """``num`` windows of Poisson arrivals at ``rate``; prompts drawn from ``mix`` (share,
    tokens); outputs of 20 tokens."""
    rng = random.Random(seed)
    t, out = 0.0, [[] for _ in range(num)]
    while True:
        t += rng.expovariate(rate)
        if t >= num * window:
            return out
        pick, prompt = rng.random(), mix[-1][1]
        for share, tokens in mix:
            if pick < share:
                prompt = tokens
                break
            pick -= share
        out[int(t // window)].append(SimRequest(t, prompt, 20))


def _run_windows(planner: Planner, windows, window: float = 10.0, start=(1, 1)):
    sizes, decisions = start, []
    for tick, requests in enumerate(windows):
        decision = planner.tick(Observation(tick * window, *sizes, window, tuple(requests)))
        decisions.append(decision)
        sizes = (decision.prefill, decision.decode)
    return decisions


def _directions(sizes: list[int]) -> list[int]:
    return [(b > a) - (b < a) for a, b in itertools.pairwise(sizes) if a != b]


def test_a_step_is_told_from_poisson_noise():
    rng = random.Random(3)
    forecast, alarms = RateForecast(), 0
    for _ in range(500):  # 30 s windows at 2 req/s: a count's sigma is ~7.7 of 60
        count = sum(1 for _ in range(120) if rng.random() < 0.5)  # binomial ~ Poisson here
        forecast.update(count / 30.0, 30.0)
        alarms += forecast.is_step
    assert alarms == 0  # 4 sigmas: a false step about once in 30,000 windows
    level_before = forecast.level
    after = forecast.update(4.0, 30.0)  # 120 arrivals where ~60 were due: a step
    assert forecast.is_step and after == 4.0 and forecast.trend == 0.0
    assert forecast.windows_at_level == 1 and level_before < 2.5
    # right after the step the band is wider (the level rests on one window) ...
    assert plan_rate(4.0, 30.0, 1.0, 1) == pytest.approx(4.0 + (2 * 4.0 / 30.0) ** 0.5)
    # ... and narrows to one window's spread as windows at the level add up
    assert plan_rate(4.0, 30.0, 1.0, 10**9) == pytest.approx(4.0 + (4.0 / 30.0) ** 0.5)


def test_a_noisy_constant_load_never_reverses():
    # Poisson windows near the 1-vs-2 prefill threshold, three seeds: the sizes may grow,
    # then hold; no pool ever goes up and down (or down and up).
    for seed in (11, 12, 13):
        windows = poisson_windows(7.0, 40, 10.0, seed)
        decisions = _run_windows(_planner(), windows)
        for pool in ("prefill", "decode"):
            moves = _directions([1] + [getattr(d, pool) for d in decisions])
            assert len(set(moves)) <= 1, (seed, pool, moves)


def test_a_step_is_sized_for_the_recent_mix_within_two_ticks():
    # A bimodal mix (10% prompts of 1200 tokens) at 1 req/s, then a step to 5 req/s whose
    # first window happens to bring only short prompts: sized at once for the mix of the
    # windows before (the next windows bring the long ones), not after the miss.
    config = dict(ttft_p90_ms=1500, itl_p90_ms=60, max_workers=8, cooldown_s=30,
                  limits=PoolLimits(max_batched_tokens=256))  # fmt: skip
    mix = ((0.9, 100), (0.1, 1200))
    before = poisson_windows(1.0, 6, 10.0, 5, mix)
    step = [[r for r in poisson_windows(5.0, 1, 10.0, 6, ((1.0, 100),))[0]]]
    after = poisson_windows(5.0, 4, 10.0, 7, mix)
    windows = before + [[SimRequest(r.arrival_s + 60.0, r.prompt_tokens, r.output_tokens)
                         for r in step[0]]] + [
        [SimRequest(r.arrival_s + 70.0, r.prompt_tokens, r.output_tokens) for r in w]
        for w in after
    ]  # fmt: skip
    decisions = _run_windows(Planner(PlannerConfig(**config), trained_model()), windows)
    assert all(d.prefill == 1 for d in decisions[:6])
    assert decisions[6].prefill >= 2, [d.reason for d in decisions]
    # one window's mix alone (mix_windows=1) waits for the long prompts to show up
    alone = _run_windows(Planner(PlannerConfig(**config, mix_windows=1), trained_model()), windows)
    assert alone[6].prefill == 1


def test_no_scale_down_within_the_dwell_after_a_scale_up():
    planner = _planner(down_dwell_cooldowns=4.0)  # cooldown 30 s: no down for 120 s
    decisions = _run(planner, [1.0] * 2 + [12.0] * 2 + [1.0] * 20)
    prefill = [d.prefill for d in decisions]
    up = next(i for i, p in enumerate(prefill) if p >= 2)
    down = next(i for i in range(up + 1, len(prefill)) if prefill[i] < prefill[i - 1])
    assert (down - up) * 10.0 >= 120.0, prefill
    assert "scale down" in decisions[down].reason
