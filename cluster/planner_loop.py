"""The SLA planner's loop in the router process: observe -> decide -> act, once per tick.

Every ``planner.interval_seconds`` (docs/planner.md):

1. **observe**: the feed's window (``cluster/planner_feed.py``: the steps read off the
   workers' batches, the arrivals and their lengths, the measured TTFT and ITL); the
   step records go into the fits, where a new worker's first ``warmup_steps`` are left out;
2. **re-read** the pools' actual sizes from the scaler (a ``baton scale`` since the last
   tick shows here, and the planner takes it as the new base: a manual change wins);
3. **decide** with the pure policy (``cluster/planner/policy.py``);
4. **act** through the :class:`~cluster.planner.actuator.Scaler` (the router's live
   scaling, behind ``cluster/ray_actuator.py`` on Ray; ``VirtualScaler`` in tests), as a
   task of its own: adding a worker takes seconds to minutes, and the ticks go on. While a
   scaling runs the planner holds (its target is not reached yet, and acting again would
   queue behind it); its step records still feed the fits.

Each tick's decision, its reason and the predicted and measured p90s go to the log and to
Prometheus (``cluster/planner_metrics.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from cluster.planner.actuator import Scaler
from cluster.planner.policy import Decision, Observation, Planner
from cluster.planner.simulator import percentile
from cluster.planner_feed import Window
from cluster.planner_metrics import PlannerMetrics

logger = logging.getLogger(__name__)

_NUM_KEPT = 1024  # ticks kept in ``history`` (for `baton status`-like readers and tests)


class Feed(Protocol):
    def take(self, now: float) -> Window:
        """The window ending at ``now``; its records are handed over once."""


class PlannerLoop:
    """Ticks ``planner`` every ``interval_s`` on the router's event loop (the router's
    ``Background``: started and stopped with it)."""

    def __init__(
        self,
        planner: Planner,
        feed: Feed,
        scaler: Scaler,
        interval_s: float,
        metrics: PlannerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.planner = planner
        self.feed = feed
        self.scaler = scaler
        self.interval_s = interval_s
        self.metrics = metrics
        self.clock = clock
        # (now, decision, measured ttft p90 s, measured itl p90 s): the newest last
        self.history: deque[tuple[float, Decision, float | None, float | None]] = deque(
            maxlen=_NUM_KEPT
        )
        self._task: asyncio.Task | None = None
        self._scaling: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._scaling) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def is_scaling(self) -> bool:
        return self._scaling is not None and not self._scaling.done()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # a bug in a tick must not end the planning for good
                logger.exception("planner: the tick failed")

    def tick(self) -> Decision:
        """One observe -> decide -> act round; the scaling it starts runs as a task."""
        now = self.clock()
        window = self.feed.take(now)
        model = self.planner.step_model
        num_left_out = sum(not model.observe(step) for step in window.steps)
        current = self.scaler.current()
        if self.is_scaling:
            decision = Decision(*current, "hold: a scaling is in progress")
        else:
            obs = Observation(now, *current, self.interval_s, window.requests)
            decision = self.planner.tick(obs)
            if decision.is_change:
                self._scaling = asyncio.get_running_loop().create_task(self._act(decision))
        ttft = percentile(window.ttft_s, 0.9) if window.ttft_s else None
        itl = percentile(window.itl_s, 0.9) if window.itl_s else None
        self.history.append((now, decision, ttft, itl))
        if self.metrics is not None:
            self.metrics.tick(decision, current, ttft, itl, num_left_out)
        log = logger.warning if decision.is_change else logger.info
        log(
            "planner: %s -> %s (%s); %d arrivals, measured p90 TTFT %s, ITL %s",
            current,
            (decision.prefill, decision.decode),
            decision.reason,
            len(window.requests),
            "-" if ttft is None else f"{ttft * 1e3:.0f} ms",
            "-" if itl is None else f"{itl * 1e3:.1f} ms",
        )
        return decision

    async def _act(self, decision: Decision) -> None:
        target = (decision.prefill, decision.decode)
        try:
            await self.scaler.scale_to(*target)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused (no room, draining) or a worker did not join
            # The counts stay what they are; next tick re-reads them (as a manual change).
            logger.warning("planner: scaling to %s failed: %s", target, exc)
            if self.metrics is not None:
                self.metrics.failed()
