"""The arrival rate the planner sizes the pools for: a forecast of the next window, with
headroom for the window's own randomness.

Two parts, both needed to react within a tick or two without flapping:

- **Holt's linear smoothing** (level + trend) of the windows' rates follows a rate that
  rises or falls through the day;
- the rate to **plan** for is the larger of that forecast and the rate just observed (a
  smoothed level lags a step in load by several windows: after a step up the last window
  is the better guess), plus ``headroom_sigmas`` standard deviations of a Poisson window's
  count at that rate: a window of 60 arrivals is as likely to bring 68 (one sigma), and a
  pool sized for exactly the mean misses its p90 in every such window. The headroom
  shrinks relative to the rate as the rate grows (sqrt), so a busy pool is not
  over-provisioned by it.
"""

from __future__ import annotations

import math


class RateForecast:
    """Feed one window's arrival rate per tick (``update``); read the rate to plan for."""

    def __init__(self, smoothing: float = 0.5, trend_smoothing: float = 0.3) -> None:
        self.smoothing = smoothing
        self.trend_smoothing = trend_smoothing
        self.level: float | None = None
        self.trend = 0.0

    def update(self, rate: float) -> float:
        """Add the last window's rate (requests per second); the next window's forecast."""
        if self.level is None:
            self.level = rate
            return rate
        previous = self.level
        a, b = self.smoothing, self.trend_smoothing
        self.level = a * rate + (1 - a) * (previous + self.trend)
        self.trend = b * (self.level - previous) + (1 - b) * self.trend
        return max(0.0, self.level + self.trend)


def plan_rate(forecast: float, observed: float, window_s: float, headroom_sigmas: float) -> float:
    """The rate to size for: max(forecast, observed) plus the Poisson headroom of a window
    (the standard deviation of a window's rate is sqrt(rate / window_s))."""
    rate = max(forecast, observed)
    if rate <= 0.0:
        return 0.0
    return rate + headroom_sigmas * math.sqrt(rate / window_s)
