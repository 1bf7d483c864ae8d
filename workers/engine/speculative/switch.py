"""Speculate only where it is faster: measured decode rates with and without it.

Whether verifying k extra tokens per request pays depends on the batch size, the models,
the machine and how often proposals are accepted, so the engine measures: for steps that
only decode (no prefill chunk), the tokens each request got per second of the whole step
(draft forwards included), kept per batch-size bucket (1, 2-3, 4-7, 8-15, ...) as a moving
average for steps that speculated and steps that did not. A bucket speculates while its
speculating rate is at least the plain one. Each mode is tried where it has no
measurement yet, and the mode not chosen is tried again every ``explore_every`` steps of
the bucket, so a change of workload (acceptance) shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ALPHA = 0.25  # weight of the newest step in the moving averages


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # speculated -> tokens/s/request
    steps: int = 0


class SpeculationSwitch:
    def __init__(self, explore_every: int = 24) -> None:
        self.explore_every = explore_every
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return num_decodes.bit_length()

    def speculate(self, num_decodes: int) -> bool:
        """Whether a step with ``num_decodes`` running decodes should speculate."""
        b = self._buckets.setdefault(self.bucket(num_decodes), _Bucket())
        b.steps += 1
        if True not in b.rate:
            return True
        if False not in b.rate:
            return False
        best = b.rate[True] >= b.rate[False]
        if b.steps % self.explore_every == 0:
            return not best
        return best

    def observe(self, num_decodes: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of ``num_decodes`` requests emitted ``tokens`` in ``seconds``."""
        if num_decodes < 1 or seconds <= 0:
            return
        rate = tokens / num_decodes / seconds
        b = self._buckets.setdefault(self.bucket(num_decodes), _Bucket())
        old = b.rate.get(speculated)
        b.rate[speculated] = rate if old is None else (1 - _ALPHA) * old + _ALPHA * rate

    def rates(self) -> dict[int, dict[bool, float]]:
        """Per bucket, the measured rates (for benchmarks and debugging)."""
        return {k: dict(b.rate) for k, b in sorted(self._buckets.items())}
