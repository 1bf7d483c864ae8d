"""When a pool was computing: merged busy intervals, and the share of a span they cover.

Why: where the prefill and decode pools share a machine's cores (a CPU host, or both on
one accelerator), a step runs slower while the other pool computes. The validation against
real engines (``bench/planner_validate.py``) measured decode steps at 0.92x their fit when
no prefill step overlapped them and about 1.4x when one did, and prefill steps 0.67x
against 1.08x. The step-time fits take that share as a feature (``StepModel``: an
``overlap`` per record), and the simulation asks a ``BusyTimeline`` of the other pool for
it, step by step. On separate accelerators the fitted coefficient is ~0 and nothing changes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable


class BusyTimeline:
    """The union of ``(start, end)`` intervals; ``share(a, b)`` in O(log n)."""

    def __init__(self, intervals: Iterable[tuple[float, float]]) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []
        for start, end in sorted(intervals):
            if end <= start:
                continue
            if self._ends and start <= self._ends[-1]:  # overlaps the last one: merge
                self._ends[-1] = max(self._ends[-1], end)
            else:
                self._starts.append(start)
                self._ends.append(end)
        self._before: list[float] = []  # busy time before each interval
        total = 0.0
        for start, end in zip(self._starts, self._ends, strict=True):
            self._before.append(total)
            total += end - start

    def _busy_until(self, t: float) -> float:
        i = bisect_right(self._starts, t) - 1
        if i < 0:
            return 0.0
        return self._before[i] + min(t, self._ends[i]) - self._starts[i]

    def share(self, start: float, end: float) -> float:
        """The share of ``[start, end]`` covered by the intervals (0 for an empty span)."""
        if end <= start:
            return 0.0
        return (self._busy_until(end) - self._busy_until(start)) / (end - start)
