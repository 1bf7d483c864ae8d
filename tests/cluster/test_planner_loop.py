"""The planner's loop (cluster/planner_loop.py) with a virtual actuator and synthetic
windows; the feed that reads steps and latencies off the router's batches
(cluster/planner_feed.py); the Ray actuator's autoscaler request; the metrics; the
``planner:`` config section's errors. All in-process, a few seconds."""

from __future__ import annotations

import asyncio
import re
import sys
import types
from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY

from cluster.config import parse_config
from cluster.config_schema import ConfigError
from cluster.planner.actuator import VirtualScaler
from cluster.planner.policy import Planner, PlannerConfig
from cluster.planner.simulator import SimRequest
from cluster.planner.step_model import DecodeStep, PrefillStep, StepModel
from cluster.planner_feed import LoadFeed, Window
from cluster.planner_loop import PlannerLoop
from cluster.planner_metrics import PlannerMetrics
from workers.protocol.wire import OutputBatch, TokenEvent, WorkerReport

INTERVAL_S = 10.0
# The synthetic machine: a prefill step costs 20 ms + 0.4 ms per token, a decode step
# 10 ms + 1 ms per sequence + 0.2 ms per thousand KV tokens.
PREFILL = (0.020, 0.0004)
DECODE = (0.010, 0.001, 0.0002)


def steps(worker: str, count: int, slow: float = 1.0) -> list[PrefillStep | DecodeStep]:
    """``count`` prefill and decode records each, ``slow`` x the machine's step time."""
    out: list[PrefillStep | DecodeStep] = []
    for i in range(count):
        tokens = 100 + 61 * (i % 20)
        out.append(PrefillStep(f"p-{worker}", slow * (PREFILL[0] + PREFILL[1] * tokens), tokens, 0))
        batch, kv = 1 + i % 16, 400 * (1 + i % 30)
        seconds = DECODE[0] + DECODE[1] * batch + DECODE[2] * kv / 1000
        out.append(DecodeStep(f"d-{worker}", slow * seconds, batch, kv))
    return out


def arrivals(rate: float, end_s: float, prompt: int = 500, output: int = 40):
    count = int(rate * INTERVAL_S)
    start = end_s - INTERVAL_S
    return tuple(SimRequest(start + i / rate, prompt, output) for i in range(count))


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class FakeFeed:
    """Windows on demand: the test sets the next one's rate and records."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.rate = 1.0
        self.steps: list[PrefillStep | DecodeStep] = []

    def take(self, now: float) -> Window:
        records, self.steps = tuple(self.steps), []
        return Window(arrivals(self.rate, now), records, (0.5,), (0.02,), 0.0)


def make_loop(cooldown_s: float = 20.0, warmup_steps: int = 0, max_workers: int = 6):
    clock = Clock()
    config = PlannerConfig(
        ttft_p90_ms=1000.0, itl_p90_ms=100.0, max_workers=max_workers, cooldown_s=cooldown_s
    )
    planner = Planner(config, StepModel(warmup_steps=warmup_steps))
    feed = FakeFeed(clock)
    scaler = VirtualScaler(1, 1, max_workers=max_workers, clock=clock)
    loop = PlannerLoop(planner, feed, scaler, INTERVAL_S, PlannerMetrics("test-model"), clock)
    return loop, feed, scaler, clock


async def tick(loop: PlannerLoop, clock: Clock):
    clock.now += INTERVAL_S
    decision = loop.tick()
    await asyncio.sleep(0)  # the scaling task runs (VirtualScaler: at once)
    await asyncio.sleep(0)
    return decision


def test_a_load_step_grows_prefill_within_two_ticks_and_quiet_shrinks_it():
    async def body():
        loop, feed, scaler, clock = make_loop()
        feed.steps = steps("0", 40)
        for _ in range(4):  # 1 req/s: one worker each meets the SLA
            decision = await tick(loop, clock)
        assert scaler.current() == (1, 1) and scaler.calls == []
        assert decision.reason == "hold: sizes meet the SLA"
        feed.rate = 6.0  # 6 x 0.22 s of prefill per second: one worker cannot keep up
        grown_at = None
        for n in (1, 2):
            await tick(loop, clock)
            if scaler.current()[0] > 1:
                grown_at = n
                break
        assert grown_at is not None, loop.history[-1][1].reason
        assert loop.history[-1][1].reason.startswith("scale up")
        peak = scaler.current()[0]
        assert peak >= 2
        for _ in range(3):  # load stays: no reversal
            await tick(loop, clock)
        assert scaler.current()[0] == peak
        feed.rate = 0.5
        sizes = []
        for _ in range(2 * (peak + 2)):
            await tick(loop, clock)
            sizes.append(scaler.current()[0])
        assert sizes[-1] == 1, sizes
        assert all(b == a or b == a - 1 for a, b in zip([peak, *sizes[:-1]], sizes, strict=True)), (
            sizes
        )  # by one
        assert scaler.current()[1] >= 1

    asyncio.run(body())


def test_a_manual_change_is_respected():
    async def body():
        loop, feed, scaler, clock = make_loop(cooldown_s=30.0)
        feed.steps = steps("0", 40)
        await tick(loop, clock)
        await tick(loop, clock)
        assert scaler.current() == (1, 1)
        scaler.prefill, scaler.decode = 3, 2  # `baton scale --prefill 3 --decode 2`
        decision = await tick(loop, clock)
        assert decision.reason == "hold: manual change respected"
        assert (decision.prefill, decision.decode) == (3, 2)
        await tick(loop, clock)
        await tick(loop, clock)  # within the cooldown: held, though one of each would do
        assert scaler.current() == (3, 2) and scaler.calls == []
        for _ in range(8):  # after it, the planner sizes down again, each pool by one a tick
            await tick(loop, clock)
        assert scaler.calls == [(2, 1), (1, 1)]

    asyncio.run(body())


def test_a_new_workers_first_steps_are_left_out_of_the_fits():
    async def body():
        loop, feed, scaler, clock = make_loop(warmup_steps=20)
        feed.steps = steps("cold", 20, slow=40.0) + steps("cold", 30)  # cold start, then normal
        await tick(loop, clock)
        model = loop.planner.step_model
        assert model.prefill.num_records == 30 and model.decode.num_records == 30
        assert model.prefill_seconds(500, 0.0) == pytest.approx(0.22, rel=1e-3)
        left_out = REGISTRY.get_sample_value(
            "baton_planner_steps_left_out_total",
            {"role": "router", "model": "test-model", "instance": "router"},
        )
        assert left_out is not None and left_out >= 40
        assert scaler.calls == []  # the slow records would have asked for more workers

    asyncio.run(body())


def test_holds_while_a_scaling_runs_and_records_each_decision():
    async def body():
        loop, feed, scaler, clock = make_loop()
        scaler.delay_s = 25.0  # a worker takes 25 s to join
        feed.steps = steps("0", 40)
        feed.rate = 6.0
        await tick(loop, clock)
        assert len(scaler.calls) == 1
        loop._scaling = asyncio.get_running_loop().create_future()  # still joining
        decision = await tick(loop, clock)
        assert decision.reason == "hold: a scaling is in progress"
        assert len(scaler.calls) == 1
        labels = {"role": "router", "model": "test-model", "instance": "router"}
        ups = REGISTRY.get_sample_value(
            "baton_planner_decisions_total", {**labels, "action": "up", "reason": "scale up"}
        )
        assert ups is not None and ups >= 1
        measured = REGISTRY.get_sample_value(
            "baton_planner_ttft_p90_seconds", {**labels, "source": "measured"}
        )
        assert measured == pytest.approx(0.5)
        loop._scaling.cancel()

    asyncio.run(body())


# ---- the feed: steps and latencies read off the router's batches ----------------------


@dataclass
class FakeClient:
    name: str
    role: str


@dataclass
class FakeView:
    client: FakeClient

    @property
    def name(self) -> str:
        return self.client.name


def batch(name: str, role: str, *events: TokenEvent) -> OutputBatch:
    report = WorkerReport(name, role, True, len(events), 0, 100, 10, 0, 0)
    return OutputBatch(events, report)


def test_the_feed_reads_steps_ttft_and_itl_off_the_batches():
    clock = Clock()
    feed = LoadFeed(INTERVAL_S, clock)
    prefill, decode = (
        FakeView(FakeClient("prefill-0", "prefill")),
        FakeView(FakeClient("decode-0", "decode")),
    )
    clock.now = 100.0
    feed.arrived("r1", 300)
    clock.now = 100.3
    feed.batch(
        prefill,
        batch(
            "prefill-0",
            "prefill",
            TokenEvent("r1", (7,), False, None, None, 300, 100, kv_handles=(b"h",)),
        ),
    )
    clock.now = 100.4
    feed.batch(decode, batch("decode-0", "decode", TokenEvent("r1", (8,), False)))
    clock.now = 100.45
    feed.batch(decode, batch("decode-0", "decode", TokenEvent("r1", (9, 10), False)))
    clock.now = 100.5
    feed.ended("r1", 4, 100)
    window = feed.take(101.0)
    pre, d1, d2 = window.steps
    assert pre == PrefillStep("prefill-0#0", pytest.approx(0.3), 200, pytest.approx(40.0))
    # the first decode step starts when its request was ready (the prefill's end), not before
    assert d1 == DecodeStep("decode-0#0", pytest.approx(0.1), 1, 301)
    assert d2 == DecodeStep("decode-0#0", pytest.approx(0.05), 1, 302)
    assert window.ttft_s == (pytest.approx(0.3),)
    assert window.itl_s == pytest.approx((0.1, 0.025, 0.025))
    assert window.requests == (SimRequest(100.0, 200, 4),)
    assert window.prefix_hit_share == pytest.approx(1 / 3)
    assert feed.take(102.0).steps == ()  # handed over once


def test_a_report_without_output_does_not_start_a_step():
    # A heartbeat (or a receive's notice) between two decode steps: the step still spans
    # token batch to token batch, as the tokens' gap does.
    clock = Clock()
    feed = LoadFeed(INTERVAL_S, clock)
    decode = FakeView(FakeClient("decode-0", "decode"))
    clock.now = 100.0
    feed.arrived("r1", 10)
    feed._requests["r1"].ready_s = feed._requests["r1"].last_token_s = 100.0  # prefilled
    for now, events in ((100.1, (TokenEvent("r1", (8,), False),)), (100.15, ())):
        clock.now = now
        feed.batch(decode, batch("decode-0", "decode", *events))
    clock.now = 100.2
    feed.batch(decode, batch("decode-0", "decode", TokenEvent("r1", (9,), False)))
    window = feed.take(101.0)
    assert [s.seconds for s in window.steps] == pytest.approx([0.1, 0.1])
    assert window.itl_s == pytest.approx((0.1, 0.1))


def test_a_restarted_worker_is_a_new_worker_to_the_fits():
    clock = Clock()
    feed = LoadFeed(INTERVAL_S, clock)
    first = FakeView(FakeClient("prefill-0", "prefill"))
    restarted = FakeView(FakeClient("prefill-0", "prefill"))  # same name, new client
    for view, rid in ((first, "a"), (restarted, "b")):
        feed.arrived(rid, 50)
        clock.now += 0.1
        event = TokenEvent(rid, (1,), False, None, None, 50, 0, kv_handles=(b"h",))
        feed.batch(view, batch("prefill-0", "prefill", event))
    ids = [s.worker_id for s in feed.take(clock.now).steps]
    assert ids == ["prefill-0#0", "prefill-0#1"]


def test_a_running_request_counts_with_a_recent_output_length():
    clock = Clock(50.0)
    feed = LoadFeed(INTERVAL_S, clock)
    feed.arrived("done", 100)
    feed.ended("done", 64, 0)
    feed.arrived("running", 100)
    window = feed.take(55.0)
    assert [r.output_tokens for r in window.requests] == [64, 64]


# ---- the Ray actuator ---------------------------------------------------------------


def test_the_ray_actuator_asks_the_autoscaler_only_where_there_is_one(monkeypatch):
    from cluster import planner_ray
    from workers.serving.worker_spec import WorkerSpec

    asked: list[list[dict]] = []
    sdk = types.ModuleType("ray.autoscaler.sdk")
    sdk.request_resources = lambda bundles=None, num_cpus=None: asked.append(bundles)
    monkeypatch.setitem(sys.modules, "ray.autoscaler.sdk", sdk)
    monkeypatch.setattr(planner_ray.ray, "is_initialized", lambda: True)

    class Scaling:
        def __init__(self):
            self.calls = []

        def current(self):
            return (1, 1)

        async def scale_to(self, p, d):
            self.calls.append((p, d))

    spec = WorkerSpec.__new__(WorkerSpec)
    monkeypatch.setattr(WorkerSpec, "num_ranks", property(lambda self: 2))
    templates = {"prefill": (spec, {"CPU": 1.0}), "decode": (spec, {"CPU": 1.0, "GPU": 1.0})}
    scaling = Scaling()
    none_here = planner_ray.RayActuator(scaling, templates, has_autoscaler=False)
    asyncio.run(none_here.scale_to(2, 1))
    assert asked == [] and scaling.calls == [(2, 1)]
    actuator = planner_ray.RayActuator(scaling, templates, has_autoscaler=True)
    asyncio.run(actuator.scale_to(2, 1))
    assert asked == [[{"CPU": 1.0}] * 4 + [{"CPU": 1.0, "GPU": 1.0}] * 2]
    assert scaling.calls == [(2, 1), (2, 1)]


# ---- the config section -------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"planner": {"max_workers": 1}}, "planner.max_workers: must be >= 2, got 1"),
        ({"planner": {"interval_seconds": 0}}, "planner.interval_seconds: must be > 0"),
        ({"planner": {"ttft_p90_ms": "fast"}}, "planner.ttft_p90_ms: expected a number"),
        ({"planner": {"down_margin": 1.5}}, "planner.down_margin: must be <= 1"),
        ({"planner": {"cooldown": 5}}, "planner.cooldown: unknown key"),
        ({"planner": {"down_windows": 0}}, "planner.down_windows"),
        ({"planner": {"headroom_sigmas": -1}}, "planner.headroom_sigmas"),
        ({"planner": {"step_sigmas": 0}}, "planner.step_sigmas"),
        ({"planner": {"mix_windows": 0}}, "planner.mix_windows"),
        ({"planner": {"down_dwell_cooldowns": -1}}, "planner.down_dwell_cooldowns"),
        ({"planner": {"down_hysteresis_sigmas": -0.5}}, "planner.down_hysteresis_sigmas"),
        (
            {"planner": {"min_prefill": 3, "min_decode": 2, "max_workers": 4}},
            "planner: max_workers: 4 is below min_prefill + min_decode (5)",
        ),
        (
            {"planner": {"enabled": True, "max_workers": 6}, "router": {"scale_max_replicas": 4}},
            "planner.max_workers (6) is above router.scale_max_replicas (4)",
        ),
    ],
)
def test_planner_config_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(data)


def test_planner_is_off_by_default_and_its_settings_reach_the_policy():
    from cluster.planner.simulator import PoolLimits

    assert parse_config({}).planner.enabled is False
    settings = {"enabled": True, "ttft_p90_ms": 500, "max_workers": 3, "down_windows": 2}
    extra = {"headroom_sigmas": 0.5, "step_sigmas": 5, "mix_windows": 2, "down_dwell_cooldowns": 1}
    section = parse_config({"planner": {**settings, **extra}}).planner
    policy = section.policy_config(PoolLimits(max_batched_tokens=512))
    assert (policy.ttft_p90_ms, policy.max_workers, policy.limits.max_batched_tokens) == (
        500,
        3,
        512,
    )
    assert (policy.down_windows, policy.headroom_sigmas) == (2, 0.5)
    assert (policy.step_sigmas, policy.mix_windows, policy.down_dwell_cooldowns) == (5, 2, 1)
    assert policy.down_hysteresis_sigmas == 2.0  # the default
