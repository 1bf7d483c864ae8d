"""The arrival rate the planner sizes the pools for: a forecast of the next window, with
headroom for the window's own randomness and for how little is known of a new level.

Three parts, all needed to react within a tick or two without flapping:

- **Holt's linear smoothing** (level + trend) of the windows' rates follows a rate that
  rises or falls through the day. It is smoothed hard (level weight 0.3, trend 0.1): the
  rate planned for is the forecast, not the last window's count, so a Poisson window's
  luck (one sigma is 13% of 60 arrivals) does not move the pools; at a constant load near
  a pool's limit, planning on the last count grew the pool on a high count and shrank it
  on the next low ones (tests/cluster/test_planner.py, a noisy constant load);
- **a step detector**: a window whose count lies more than ``step_sigmas`` (4) Poisson
  standard deviations above the forecast is a step in load, not noise (at 3 sigmas the
  discrete Poisson tail tripped it on constant loads of 40 arrivals a window, about once
  in 500 windows). At a step the level restarts at the rate seen and the trend at 0: the
  smoothed level would take many windows to climb there, and its trend would pick up the
  jump and overshoot afterwards (a scale-up the next windows undo). Only steps up: a fall
  is left to the smoothing and to the policy's slow, hysteretic scale-down;
- the rate to **plan** for is the forecast plus ``headroom_sigmas`` standard deviations of
  the next window's rate. Two things make that spread: a Poisson window's own count, and
  the level's estimate, which rests on the ``k`` windows seen since the last step
  (variance ``rate / (k * window_s)``): right after a step the new level is one window's
  count, and the band is wider (sqrt 2 at k = 1), so a scale-up sizes for the upper end of
  what the step may be rather than waiting for the next window to confirm it. The headroom
  shrinks relative to the rate as the rate grows (sqrt), so a busy pool is not
  over-provisioned by it.
"""

from __future__ import annotations

import math


class RateForecast:
    """Feed one window's arrival rate per tick (``update``); read the rate to plan for."""

    def __init__(
        self, smoothing: float = 0.3, trend_smoothing: float = 0.1, step_sigmas: float = 4.0
    ) -> None:
        self.smoothing = smoothing
        self.trend_smoothing = trend_smoothing
        self.step_sigmas = step_sigmas
        self.level: float | None = None
        self.trend = 0.0
        self.windows_at_level = 0  # windows since the level (re)started: its estimate's weight
        self.is_step = False  # the last window was a step up

    def update(self, rate: float, window_s: float | None = None) -> float:
        """Add the last window's rate (requests per second over ``window_s``; without it no
        step test); the next window's forecast."""
        if self.level is None:
            self.level, self.windows_at_level, self.is_step = rate, 1, False
            return rate
        expected = max(0.0, self.level + self.trend)
        self.is_step = window_s is not None and is_step_up(
            rate, expected, window_s, self.step_sigmas
        )
        if self.is_step:  # a new level: restart there, with no trend from the jump
            self.level, self.trend, self.windows_at_level = rate, 0.0, 1
            return rate
        previous = self.level
        a, b = self.smoothing, self.trend_smoothing
        self.level = a * rate + (1 - a) * (previous + self.trend)
        self.trend = b * (self.level - previous) + (1 - b) * self.trend
        self.windows_at_level += 1
        return max(0.0, self.level + self.trend)


def is_step_up(rate: float, expected: float, window_s: float, sigmas: float) -> bool:
    """A one-sided Poisson test of a window's count against the expected count: more than
    ``sigmas`` standard deviations above it (the deviation of at least one arrival, so an
    idle forecast is not tripped by a single request)."""
    count, mean = rate * window_s, expected * window_s
    return count - mean > sigmas * math.sqrt(max(mean, 1.0))


def plan_rate(
    forecast: float, window_s: float, headroom_sigmas: float, windows_at_level: int | None = None
) -> float:
    """The rate to size for: the forecast plus ``headroom_sigmas`` deviations of the next
    window's rate: a window's Poisson spread (variance ``rate / window_s``) and, with
    ``windows_at_level`` = k, the level's estimate from k windows (``rate / (k *
    window_s)``)."""
    if forecast <= 0.0:
        return 0.0
    variance = forecast / window_s
    if windows_at_level:
        variance *= 1.0 + 1.0 / windows_at_level
    return forecast + headroom_sigmas * math.sqrt(variance)
