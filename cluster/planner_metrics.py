"""The SLA planner's Prometheus series (docs/metrics.md, "Planner series"), recorded by the
router process's loop (``cluster/planner_loop.py``) once per tick.

Every series carries ``role="router"``, ``model`` and ``instance="router"``:

- ``baton_planner_decisions_total{action,reason}``: one per tick; ``action`` is ``up``,
  ``down`` or ``hold``, ``reason`` the decision's kind without its numbers (``scale up``,
  ``hold: sizes meet the SLA``, ...; the whole reason, numbers included, is logged);
- ``baton_planner_workers{pool,kind}``: ``current`` (re-read each tick: a manual change
  shows) and ``target`` (the last decision) per pool;
- ``baton_planner_ttft_p90_seconds{source}`` / ``baton_planner_itl_p90_seconds{source}``:
  ``predicted`` (the simulation's, at the decided sizes, for the next window) and
  ``measured`` (the last window's, router-side);
- ``baton_planner_forecast_requests_per_second``: the forecast arrival rate;
- ``baton_planner_steps_left_out_total``: step records a new worker's warm-up kept out of
  the fits (cold starts);
- ``baton_planner_scale_failures_total``: scalings the cluster refused or that failed.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from cluster.planner.policy import Decision
from workers.protocol.metrics import LABELS

DECISIONS = Counter(
    "baton_planner_decisions",
    "Planner decisions, one per tick, by action (up, down, hold) and kind of reason",
    (*LABELS, "action", "reason"),
)
WORKERS = Gauge(
    "baton_planner_workers",
    "Workers per pool: current (re-read each tick) and target (the last decision)",
    (*LABELS, "pool", "kind"),
    multiprocess_mode="livemax",
)
TTFT_P90 = Gauge(
    "baton_planner_ttft_p90_seconds",
    "p90 time to first token: predicted for the decided sizes, measured over the last window",
    (*LABELS, "source"),
    multiprocess_mode="livemax",
)
ITL_P90 = Gauge(
    "baton_planner_itl_p90_seconds",
    "p90 inter-token latency: predicted for the decided sizes, measured over the last window",
    (*LABELS, "source"),
    multiprocess_mode="livemax",
)
FORECAST = Gauge(
    "baton_planner_forecast_requests_per_second",
    "The planner's forecast of the next window's arrival rate",
    LABELS,
    multiprocess_mode="livemax",
)
LEFT_OUT = Counter(
    "baton_planner_steps_left_out",
    "Step records left out of the step-time fits (a new worker's warm-up)",
    LABELS,
)
FAILURES = Counter("baton_planner_scale_failures", "Planner scalings refused or failed", LABELS)


def action_of(decision: Decision, current: tuple[int, int]) -> str:
    if not decision.is_change:
        return "hold"
    return "up" if decision.prefill + decision.decode > sum(current) else "down"


def reason_kind(reason: str) -> str:
    """A reason without its numbers: ``scale up: forecast 3.1 req/s ...`` -> ``scale up``."""
    return reason.split(":")[0] if reason.startswith("scale") else reason


class PlannerMetrics:
    """The series of one served model's planner."""

    def __init__(self, model: str) -> None:
        self.labels = ("router", model, "router")

    def tick(
        self,
        decision: Decision,
        current: tuple[int, int],
        measured_ttft_p90_s: float | None,
        measured_itl_p90_s: float | None,
        num_left_out: int,
    ) -> None:
        """Record one tick's decision; a measured p90 is None when the window had none."""
        labels = self.labels
        action = action_of(decision, current)
        DECISIONS.labels(*labels, action, reason_kind(decision.reason)).inc()
        for pool, now, target in zip(
            ("prefill", "decode"), current, (decision.prefill, decision.decode), strict=True
        ):
            WORKERS.labels(*labels, pool, "current").set(now)
            WORKERS.labels(*labels, pool, "target").set(target)
        TTFT_P90.labels(*labels, "predicted").set(decision.predicted_ttft_p90_ms / 1e3)
        ITL_P90.labels(*labels, "predicted").set(decision.predicted_itl_p90_ms / 1e3)
        if measured_ttft_p90_s is not None:
            TTFT_P90.labels(*labels, "measured").set(measured_ttft_p90_s)
        if measured_itl_p90_s is not None:
            ITL_P90.labels(*labels, "measured").set(measured_itl_p90_s)
        FORECAST.labels(*labels).set(decision.forecast_rate)
        if num_left_out:
            LEFT_OUT.labels(*labels).inc(num_left_out)

    def failed(self) -> None:
        FAILURES.labels(*self.labels).inc()
