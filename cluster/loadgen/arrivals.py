"""When each request is sent: offsets in seconds from the start of the run.

A rate of ``inf`` sends everything at once (a fixed concurrency then paces the run).
Otherwise inter-arrival gaps are gamma-distributed with mean ``1 / rate`` and shape
``burstiness``: 1 is a Poisson process, below 1 burstier, above 1 more regular (the same
parameterisation as ``vllm bench serve``).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if not rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (inf = all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness: must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    # Gamma(shape k, scale θ) has mean kθ: θ = 1 / (rate k) keeps the mean gap 1 / rate.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()
