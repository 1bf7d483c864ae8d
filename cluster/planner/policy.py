"""The planner's decision: the cheapest (prefill, decode) replica counts that meet the SLA.

A pure state machine (observations in, decisions out; the actuator that adds or drains
workers is elsewhere), so every rule below is tested as a function:

1. **Forecast** the next window's arrival rate: Holt's linear smoothing (level + trend) of
   the windows' rates, never below zero.
2. **Predict** p90 TTFT and ITL for candidate pool sizes by replaying the last window's
   requests (their own prompt and output lengths, so a bimodal mix stays bimodal) at the
   forecast rate through the simulation (``cluster/planner/simulator.py``) fed by the
   online step-time fits (``cluster/planner/step_model.py``).
3. **Decide** the smallest prefill count whose predicted p90 TTFT meets ``ttft_p90_ms``
   and the smallest decode count whose p90 ITL meets ``itl_p90_ms`` (each pool is searched
   with the other at its current size), within ``max_workers`` together and never below the
   minimums.
4. **Stability by construction** (the failure modes of Dynamo's planner issues):
   - up at once, by as many as needed; down by one per tick, only after ``cooldown_s``
     since the last change (the measured time to add a worker), and only when the smaller
     pool is predicted to meet the SLA with ``down_margin`` to spare: at constant load the
     decision cannot go up and back down (no 2<->1 oscillation);
   - the replica counts are re-read every tick: a count that differs from the last decision
     is a manual change, which wins: it is the new base, and the planner leaves it alone for
     ``cooldown_s`` unless the SLA needs more;
   - until the step-time fits have records past the workers' warm-up, no change (nothing to
     predict with).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cluster.planner.simulator import PoolLimits, SimRequest, simulate
from cluster.planner.step_model import StepModel


@dataclass(frozen=True)
class PlannerConfig:
    ttft_p90_ms: float = 1000.0
    itl_p90_ms: float = 100.0
    max_workers: int = 8  # prefill + decode
    min_prefill: int = 1
    min_decode: int = 1
    cooldown_s: float = 60.0  # at least the measured time to add a worker
    down_margin: float = 0.8  # scale down only if the smaller pool's p90 <= margin x target
    smoothing: float = 0.5  # Holt's level weight
    trend_smoothing: float = 0.3
    limits: PoolLimits = field(default_factory=PoolLimits)

    def __post_init__(self) -> None:
        if self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError("planner: each pool keeps at least one worker")
        if self.min_prefill + self.min_decode > self.max_workers:
            raise ValueError(
                f"planner.max_workers ({self.max_workers}) is below min_prefill + min_decode "
                f"({self.min_prefill + self.min_decode})"
            )


@dataclass(frozen=True)
class Observation:
    """What the planner sees at a tick: the pools as they are, and the last window."""

    now_s: float
    prefill: int  # replicas now (re-read: a manual change shows here)
    decode: int
    window_s: float
    requests: tuple[SimRequest, ...]  # arrived in the window, arrival times absolute


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    reason: str
    forecast_rate: float = 0.0  # requests per second
    predicted_ttft_p90_ms: float = 0.0  # at the decided sizes
    predicted_itl_p90_ms: float = 0.0

    @property
    def is_change(self) -> bool:
        return "hold" not in self.reason


class Planner:
    """Call ``tick`` once per window; ``step_model`` is fed by the workers' step records."""

    def __init__(self, config: PlannerConfig, step_model: StepModel) -> None:
        self.config = config
        self.step_model = step_model
        self._level: float | None = None
        self._trend = 0.0
        self._last: tuple[int, int] | None = None
        self._last_change_s = float("-inf")

    def _forecast(self, rate: float) -> float:
        cfg = self.config
        if self._level is None:
            self._level = rate
            return rate
        previous = self._level
        self._level = cfg.smoothing * rate + (1 - cfg.smoothing) * (previous + self._trend)
        self._trend = (
            cfg.trend_smoothing * (self._level - previous) + (1 - cfg.trend_smoothing) * self._trend
        )
        return max(0.0, self._level + self._trend)

    def _workload(self, obs: Observation, rate: float) -> list[SimRequest]:
        """The window's requests with their gaps stretched or squeezed to ``rate``."""
        if not obs.requests or rate <= 0:
            return []
        observed = len(obs.requests) / obs.window_s
        scale = observed / rate
        start = obs.requests[0].arrival_s
        return [replace(r, arrival_s=(r.arrival_s - start) * scale) for r in obs.requests]

    def _p90s(self, work: list[SimRequest], prefill: int, decode: int) -> tuple[float, float]:
        if not work:
            return 0.0, 0.0
        result = simulate(work, prefill, decode, self.step_model, self.config.limits)
        return result.ttft_p90 * 1e3, result.itl_p90 * 1e3

    def tick(self, obs: Observation) -> Decision:
        cfg = self.config
        rate = self._forecast(len(obs.requests) / obs.window_s)
        current = (obs.prefill, obs.decode)
        manual = self._last is not None and current != self._last
        if manual:  # an operator's change is the new base; hold it for a cooldown
            self._last_change_s = obs.now_s
        self._last = current
        if not self.step_model.is_ready:
            return Decision(*current, "hold: step-time fits still warming up", rate)
        work = self._workload(obs, rate)
        budget_p = cfg.max_workers - cfg.min_decode
        need_p = self._smallest(work, "ttft", obs.decode, cfg.min_prefill, budget_p)
        need_d = self._smallest(work, "itl", need_p, cfg.min_decode, cfg.max_workers - need_p)
        target_p = self._step_towards(obs.prefill, need_p, work, "ttft", obs.now_s, obs.decode)
        target_d = self._step_towards(obs.decode, need_d, work, "itl", obs.now_s, target_p)
        ttft, itl = self._p90s(work, target_p, target_d)
        if (target_p, target_d) == current:
            why = "hold: manual change respected" if manual else "hold: sizes meet the SLA"
            if need_p > obs.prefill or need_d > obs.decode:
                why = "hold: the SLA needs more than max_workers allows"
            return Decision(*current, why, rate, ttft, itl)
        self._last = (target_p, target_d)
        self._last_change_s = obs.now_s
        verb = "up" if target_p + target_d > sum(current) else "down"
        reason = (
            f"scale {verb}: forecast {rate:.2f} req/s; predicted p90 TTFT {ttft:.0f} ms "
            f"(SLA {cfg.ttft_p90_ms:.0f}), ITL {itl:.1f} ms (SLA {cfg.itl_p90_ms:.0f})"
        )
        return Decision(target_p, target_d, reason, rate, ttft, itl)

    def _meets(self, work, metric: str, prefill: int, decode: int, margin: float) -> bool:
        ttft, itl = self._p90s(work, prefill, decode)
        if metric == "ttft":
            return ttft <= margin * self.config.ttft_p90_ms
        return itl <= margin * self.config.itl_p90_ms

    def _smallest(self, work, metric: str, other: int, low: int, high: int) -> int:
        """The smallest size in [low, high] of the pool that ``metric`` depends on that
        meets it (``high`` when none does)."""
        for size in range(low, max(low, high) + 1):
            pair = (size, other) if metric == "ttft" else (other, size)
            if self._meets(work, metric, *pair, margin=1.0):
                return size
        return max(low, high)

    def _step_towards(self, now: int, need: int, work, metric: str, t: float, other: int) -> int:
        """Up at once; down by one, after the cooldown, with the margin to spare."""
        if need >= now:
            return need
        if t - self._last_change_s < self.config.cooldown_s:
            return now
        smaller = now - 1
        pair = (smaller, other) if metric == "ttft" else (other, smaller)
        return smaller if self._meets(work, metric, *pair, margin=self.config.down_margin) else now
