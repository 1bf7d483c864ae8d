"""The planner's decision: the cheapest (prefill, decode) replica counts that meet the SLA.

A pure state machine (observations in, decisions out; the actuator that adds or drains
workers is elsewhere), so every rule below is tested as a function:

1. **Forecast** the next window's arrival rate and the rate to plan for
   (``cluster/planner/forecast.py``): Holt's forecast, restarted at a detected step in
   load, plus ``headroom_sigmas`` of the next window's spread (wider right after a step).
2. **Predict** p90 TTFT and ITL for candidate pool sizes through the simulation
   (``cluster/planner/simulator.py``) fed by the online step-time fits
   (``cluster/planner/step_model.py``): the last window's requests as they came (the queue
   a busy window leaves is the next one's backlog: a pool that falls behind is seen
   falling behind before its TTFT shows it), then a typical next window at the planned
   rate (a fixed draw of Poisson gaps: the prediction moves with the rate and the mix, not
   with one window's luck) whose lengths are the last ``mix_windows`` windows' requests
   (their own prompt and output lengths, so a bimodal mix stays bimodal; after a step the
   windows before it say which long prompts the next ones may bring). That window's p90
   TTFT is the prediction.
3. **Decide** the smallest prefill count whose predicted p90 TTFT meets ``ttft_p90_ms``
   and the smallest decode count whose p90 ITL meets ``itl_p90_ms`` (each pool is searched
   with the other at its current size), within ``max_workers`` together and never below the
   minimums.
4. **Stability by construction** (the failure modes of Dynamo's planner issues):
   - up at once, by as many as needed; down by one per tick, and only when all hold:
     ``cooldown_s`` since the last change (the measured time to add a worker);
     ``down_dwell_cooldowns`` cooldowns since the last scale-up; the forecast
     ``down_hysteresis_sigmas`` Poisson deviations below the one that grew this pool (a
     pool grown on a load is not shrunk on the same load: at a constant load near a
     pool's limit no up-down pairs); and the smaller pool predicted to meet the SLA with
     ``down_margin`` to spare after each of the last ``down_windows`` windows' backlogs at
     the planned rate (one quiet window among busy ones shrinks nothing);
   - the replica counts are re-read every tick: a count that differs from the last decision
     is a manual change, which wins: it is the new base, and the planner leaves it alone for
     ``cooldown_s`` unless the SLA needs more;
   - until the step-time fits have records past the workers' warm-up, no change (nothing to
     predict with).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cluster.planner.forecast import RateForecast, plan_rate
from cluster.planner.simulator import PoolLimits, SimRequest, percentile, simulate, typical_window
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
    down_windows: int = 6  # ... in each of this many last windows
    down_hysteresis_sigmas: float = 2.0  # ... and the forecast this far below the one at the up
    mix_windows: int = 3  # the predicted window's lengths: this many last windows' requests
    down_dwell_cooldowns: float = 3.0  # after a scale-up, no scale-down for this many cooldowns
    headroom_sigmas: float = 1.0  # plan for this many deviations of the next window's rate
    step_sigmas: float = 4.0  # a window this many Poisson deviations above the forecast: a step
    smoothing: float = 0.3  # Holt's level weight
    trend_smoothing: float = 0.1
    limits: PoolLimits = field(default_factory=PoolLimits)

    def __post_init__(self) -> None:
        if self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError("planner: each pool keeps at least one worker")
        if self.min_prefill + self.min_decode > self.max_workers:
            raise ValueError(
                f"planner.max_workers ({self.max_workers}) is below min_prefill + min_decode "
                f"({self.min_prefill + self.min_decode})"
            )
        if self.down_windows < 1:
            raise ValueError(f"planner: down_windows must be >= 1, got {self.down_windows}")
        if self.down_dwell_cooldowns < 0:
            raise ValueError(
                f"planner: down_dwell_cooldowns must be >= 0, got {self.down_dwell_cooldowns}"
            )
        if self.mix_windows < 1:
            raise ValueError(f"planner: mix_windows must be >= 1, got {self.mix_windows}")


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
    forecast_rate: float = 0.0  # requests per second planned for (headroom included)
    predicted_ttft_p90_ms: float = 0.0  # at the decided sizes
    predicted_itl_p90_ms: float = 0.0

    @property
    def is_change(self) -> bool:
        return "hold" not in self.reason


@dataclass(frozen=True)
class _Workload:
    """A window replayed as it came, then as the next window at the planned rate; only the
    second part's TTFT is the prediction (the first is its backlog)."""

    requests: tuple[SimRequest, ...]
    first_predicted: int  # index of the next window's first request


class Planner:
    """Call ``tick`` once per window; ``step_model`` is fed by the workers' step records."""

    def __init__(self, config: PlannerConfig, step_model: StepModel) -> None:
        self.config = config
        self.step_model = step_model
        self._forecast = RateForecast(config.smoothing, config.trend_smoothing, config.step_sigmas)
        self._windows: deque[tuple[tuple[SimRequest, ...], float]] = deque(
            maxlen=max(config.down_windows, config.mix_windows)
        )
        self._last: tuple[int, int] | None = None
        self._last_change_s = float("-inf")
        self._last_up_s = float("-inf")
        self._up_level: dict[str, float] = {}  # per metric (ttft: prefill, itl: decode)
        self._tick = (0.0, 1.0)  # this tick's forecast and window
        self._cache: dict[tuple[int, int, int], tuple[float, float]] = {}

    def _workload(
        self, seen: tuple[SimRequest, ...], window_s: float, rate: float, mix: Sequence[SimRequest]
    ) -> _Workload:
        """``seen`` as it came, then the next window: a typical one at ``rate`` with the
        lengths of ``mix``."""
        if not mix or rate <= 0:
            return _Workload((), 0)
        start = seen[0].arrival_s if seen else 0.0
        backlog = [replace(r, arrival_s=r.arrival_s - start) for r in seen]
        ahead = typical_window(mix, rate, window_s, window_s)
        return _Workload((*backlog, *ahead), len(backlog))

    def _p90s(self, work: _Workload, prefill: int, decode: int) -> tuple[float, float]:
        if not work.requests:
            return 0.0, 0.0
        key = (id(work), prefill, decode)  # the tick's workloads live until the cache clears
        if key not in self._cache:
            result = simulate(work.requests, prefill, decode, self.step_model, self.config.limits)
            ttft = percentile(result.ttft_s[work.first_predicted :], 0.9)
            self._cache[key] = (ttft * 1e3, result.itl_p90 * 1e3)
        return self._cache[key]

    def tick(self, obs: Observation) -> Decision:
        cfg = self.config
        observed = len(obs.requests) / obs.window_s
        forecast = self._forecast.update(observed, obs.window_s)
        self._windows.append((obs.requests, obs.window_s))
        k = self._forecast.windows_at_level
        rate = plan_rate(forecast, obs.window_s, cfg.headroom_sigmas, k)
        self._tick = (forecast, obs.window_s)
        current = (obs.prefill, obs.decode)
        manual = self._last is not None and current != self._last
        if manual:  # an operator's change is the new base; hold it for a cooldown
            self._last_change_s = obs.now_s
        self._last = current
        if not self.step_model.is_ready:
            return Decision(*current, "hold: step-time fits still warming up", rate)
        self._cache.clear()
        # the next window's lengths: the last mix_windows windows' requests (one window's
        # prompts are a small sample: after a step the windows before it say what the next
        # ones may bring)
        mix = tuple(r for reqs, _ in list(self._windows)[-cfg.mix_windows :] for r in reqs)
        work = self._workload(obs.requests, obs.window_s, rate, mix)
        # a scale-down must fit each recent window's backlog followed by the next window at
        # the planned rate with the margin: a pool shrunk only where the next tick's scale-up
        # test, at the forecast's upper band, passes with room (no down-up)
        recent = [
            self._workload(reqs, w, rate, mix)
            for reqs, w in list(self._windows)[-cfg.down_windows :]
        ]
        budget_p = cfg.max_workers - cfg.min_decode
        need_p = self._smallest(work, "ttft", obs.decode, cfg.min_prefill, budget_p)
        need_d = self._smallest(work, "itl", need_p, cfg.min_decode, cfg.max_workers - need_p)
        target_p = self._step_towards(obs.prefill, need_p, recent, "ttft", obs.now_s, obs.decode)
        target_d = self._step_towards(obs.decode, need_d, recent, "itl", obs.now_s, target_p)
        ttft, itl = self._p90s(work, target_p, target_d)
        self._cache.clear()
        if (target_p, target_d) == current:
            why = "hold: manual change respected" if manual else "hold: sizes meet the SLA"
            if need_p > obs.prefill or need_d > obs.decode:
                why = "hold: the SLA needs more than max_workers allows"
            return Decision(*current, why, rate, ttft, itl)
        self._last = (target_p, target_d)
        self._last_change_s = obs.now_s
        verb = "up" if target_p + target_d > sum(current) else "down"
        if target_p > obs.prefill or target_d > obs.decode:
            self._last_up_s = obs.now_s
        if target_p > obs.prefill:  # the forecast a scale-down must fall below
            self._up_level["ttft"] = forecast
        if target_d > obs.decode:
            self._up_level["itl"] = forecast
        reason = (
            f"scale {verb}: forecast {forecast:.2f} req/s, planned {rate:.2f}; predicted p90 TTFT {ttft:.0f} ms "
            f"(SLA {cfg.ttft_p90_ms:.0f}), ITL {itl:.1f} ms (SLA {cfg.itl_p90_ms:.0f})"
        )
        return Decision(target_p, target_d, reason, rate, ttft, itl)

    def _meets(self, work: _Workload, metric: str, pair: tuple[int, int], margin: float) -> bool:
        ttft, itl = self._p90s(work, *pair)
        if metric == "ttft":
            return ttft <= margin * self.config.ttft_p90_ms
        return itl <= margin * self.config.itl_p90_ms

    def _smallest(self, work: _Workload, metric: str, other: int, low: int, high: int) -> int:
        """The smallest size in [low, high] of the pool that ``metric`` depends on that
        meets it (``high`` when none does)."""
        for size in range(low, max(low, high) + 1):
            pair = (size, other) if metric == "ttft" else (other, size)
            if self._meets(work, metric, pair, margin=1.0):
                return size
        return max(low, high)

    def _step_towards(
        self, now: int, need: int, recent: list[_Workload], metric: str, t: float, other: int
    ) -> int:
        """Up at once; down by one, after the cooldown and the dwell, with the forecast
        below the one at the last scale-up by the hysteresis, and the margin to spare
        after each of the recent windows."""
        if need >= now:
            return need
        if t - self._last_change_s < self.config.cooldown_s:
            return now
        if t - self._last_up_s < self.config.down_dwell_cooldowns * self.config.cooldown_s:
            return now
        h = self.config.down_hysteresis_sigmas
        if h and metric in self._up_level:
            level, (forecast, window_s) = self._up_level[metric], self._tick
            if forecast > level - h * (level / window_s) ** 0.5:
                return now
        smaller = now - 1
        pair = (smaller, other) if metric == "ttft" else (other, smaller)
        margin = self.config.down_margin
        return smaller if all(self._meets(w, metric, pair, margin) for w in recent) else now
