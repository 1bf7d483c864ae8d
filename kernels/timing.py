"""Start-up timings that choose between two kernels on this machine (STYLE 14).

``fastest`` runs each candidate in turn, round after round, so that a burst of load from
elsewhere falls on all of them alike, and keeps each one's best round: the minimum is the
steadiest estimate of what a call costs when nothing interferes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def fastest(calls: Sequence[Callable[[], object]], repeats: int, inner: int = 1) -> list[float]:
    """Seconds per call of each of ``calls``: the best of ``repeats`` alternating rounds,
    each round timing ``inner`` calls in a row."""
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            for _ in range(inner):
                call()
            best[i] = min(best[i], (time.perf_counter() - start) / inner)
    return best
