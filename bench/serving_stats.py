"""Statistics of bench/serving.py: percentiles and distributions in milliseconds, and the
median of each figure over repeated runs."""

from __future__ import annotations

import statistics


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (q in [0, 100]) of a non-empty list."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def dist_ms(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean in milliseconds; None for no values (JSON has no NaN)."""
    ms = [1e3 * v for v in values]
    out = {f"p{q}": round(pct(ms, q), 3) if ms else None for q in (50, 90, 99)}
    out["mean"] = round(statistics.fmean(ms), 3) if ms else None
    return out


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the repeats (None where a run has none)."""

    def median(values: list) -> float | None:
        return None if None in values else statistics.median(values)

    out = {}
    for key, value in runs[0].items():
        if isinstance(value, dict) and set(value) == {"p50", "p90", "p99", "mean"}:
            out[key] = {k: median([r[key][k] for r in runs]) for k in value}
        elif isinstance(value, float | int) and not isinstance(value, bool):
            out[key] = median([r[key] for r in runs])
    return out
