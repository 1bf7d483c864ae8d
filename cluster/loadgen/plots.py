"""PNG charts of benchmark results (matplotlib, headless).

- ``latency_cdf.png``: the CDFs of TTFT, TPOT, ITL and E2E of one run per rate.
- ``rate_sweep.png``: request throughput and goodput, and p99 TTFT / TPOT, against the
  offered request rate (when more than one rate was run).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.loadgen.metrics import tpot_s
from cluster.loadgen.runner import RequestRecord


def _pyplot():
    try:
        import matplotlib
    except ImportError:  # an optional dependency: the `plot` extra
        raise ValueError("--plot needs matplotlib: pip install 'baton[plot]'") from None
    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    return plt


def _latencies_ms(records: list[RequestRecord]) -> dict[str, np.ndarray]:
    done = [r for r in records if r.ok]
    values = {
        "TTFT": [r.ttft_s for r in done if r.ttft_s is not None],
        "TPOT": [t for r in done if (t := tpot_s(r)) is not None],
        "ITL": [g for r in done for g in r.itl_s],
        "E2E": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    return {k: np.sort(np.asarray(v)) * 1e3 for k, v in values.items()}


def plot_latency_cdfs(runs: list[tuple[str, list[RequestRecord]]], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for label, records in runs:
        for ax, (name, ms) in zip(axes, _latencies_ms(records).items(), strict=True):
            if len(ms):
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=label)
            ax.set_title(f"{name} CDF")
            ax.set_xlabel("ms")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rate_sweep(results: list[dict], path: Path) -> None:
    """``results``: summaries with ``request_rate``, in the order run; the runs at an
    unbounded rate have no place on the rate axis and are left out."""
    plt = _pyplot()
    results = [r for r in results if isinstance(r["request_rate"], (int, float))]  # not "inf"
    rates = [r["request_rate"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.plot(rates, [r["request_throughput"] for r in results], "o-", label="throughput")
    # Hollow, dashed: goodput often equals throughput, and must not hide it.
    left.plot(rates, [r["goodput"] for r in results], "s--", mfc="none", ms=9, label="goodput")
    left.plot(rates, rates, "x:", color="gray", label="offered")  # a mark even for one rate
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("req/s")
    left.legend()
    for key, marker in (("ttft_ms", "o-"), ("tpot_ms", "s-")):
        right.plot(rates, [r[key]["p99"] for r in results], marker, label=f"p99 {key[:4].upper()}")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
