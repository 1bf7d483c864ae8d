"""Who speculates each step: each request while its own acceptance pays for what it costs.

A verify step that accepts ``a`` of a request's proposals gives that request ``1 + a``
tokens where a plain step gives one, and costs more: the draft's forwards and the target's
k extra rows. Whether that pays depends on the batch size, the models, the machine and the
text, so the engine measures, per batch-size bucket (1, 2-3, 4-7, 8-15, ...), moving
averages of a decode-only step's seconds (this process's CPU seconds on CPU, steadier than
wall time on a shared machine; the draft's forwards included, its catching up a request
that sat out excluded: that is paid once per stretch of speculation): ``plain`` for steps
where nobody verified, ``spec`` for steps where every decode did. A request speculates while

    a  >=  spec / plain - 1          (the break-even accepted count)

where ``a`` is its own moving average of accepted proposals per verify step, starting from
the average over all requests. (At batch 1 on the bench pair a speculating step measured
~1.65-1.7 plain ones: a request speculates while it averages about 0.7 accepted proposals
or more, against 2.1-2.2 on average; at batch 16 only requests well above the average do,
if any.)

A request below the line learns nothing while it sits out, so each step it sits out moves
its average a step towards the average over all requests: acceptance comes in stretches,
an unpredictable stretch ends and the request is tried again; one that stays unpredictable
is pulled back down by each try.

The costs and the average over all requests would go stale where nobody speculates (or
nobody stops), so every ``explore_every`` steps of a bucket one step speculates for every
request that may and, halfway between, one step for none. Until both costs of a bucket are
measured its steps alternate between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

_ALPHA = 0.1  # weight of the newest observation: acceptance comes in bursts; ~10 steps of it


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


class StepMode(Enum):
    GATED = "gated"  # each request by its own acceptance (``AcceptanceGate.allows``)
    EVERYONE = "everyone"  # a measuring step: every request that may speculates
    NOBODY = "nobody"  # a measuring step: plain decoding


@dataclass
class _Bucket:
    seconds: dict[bool, float] = field(default_factory=dict)  # all verified? -> step seconds
    steps: int = 0


class AcceptanceGate:
    def __init__(self, explore_every: int = 50) -> None:
        self.explore_every = explore_every
        self._buckets: dict[int, _Bucket] = {}
        self._accepted: dict[str, float] = {}  # request id -> accepted per verify step
        self._overall: float | None = None  # the same, over all requests (a new one's prior)

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return num_decodes.bit_length()

    def step_mode(self, num_decodes: int) -> StepMode:
        """How the step about to be scheduled, with ``num_decodes`` decodes, decides."""
        b = self._buckets.setdefault(self.bucket(num_decodes), _Bucket())
        b.steps += 1
        if True not in b.seconds:
            return StepMode.EVERYONE
        if False not in b.seconds:
            return StepMode.NOBODY
        phase = b.steps % self.explore_every
        if phase == 0:
            return StepMode.EVERYONE
        if phase == self.explore_every // 2:
            return StepMode.NOBODY
        return StepMode.GATED

    def break_even(self, num_decodes: int) -> float:
        """Accepted proposals per verify step a request needs for speculation to pay at
        this batch size (0 until both step costs are measured)."""
        b = self._buckets.get(self.bucket(num_decodes))
        if b is None or len(b.seconds) < 2:
            return 0.0
        return max(0.0, b.seconds[True] / b.seconds[False] - 1.0)

    def allows(self, request_id: str, num_decodes: int) -> bool:
        """Whether this request speculates in a gated step of ``num_decodes`` decodes."""
        estimate = self._accepted.get(request_id, self._overall)
        if estimate is None or estimate >= self.break_even(num_decodes):
            return True
        assert self._overall is not None  # set by the first record, with the first estimate
        self._accepted[request_id] = _ewma(estimate, self._overall)  # sits out: drifts back
        return False

    def record(self, request_id: str, num_accepted: int) -> None:
        """A verify step accepted ``num_accepted`` of the request's proposals."""
        self._accepted[request_id] = _ewma(
            self._accepted.get(request_id, self._overall), num_accepted
        )
        self._overall = _ewma(self._overall, num_accepted)

    def observe(self, num_decodes: int, num_verified: int, seconds: float) -> None:
        """A decode-only step of ``num_decodes`` requests, ``num_verified`` of them verify
        chunks, took ``seconds`` (mixed steps say nothing about either cost)."""
        if num_decodes < 1 or seconds <= 0 or 0 < num_verified < num_decodes:
            return
        b = self._buckets.setdefault(self.bucket(num_decodes), _Bucket())
        everyone = num_verified == num_decodes
        b.seconds[everyone] = _ewma(b.seconds.get(everyone), seconds)

    def costs(self) -> dict[int, dict[bool, float]]:
        """Per bucket, the measured step seconds (True: everyone verified), for benchmarks
        and debugging."""
        return {k: dict(b.seconds) for k, b in sorted(self._buckets.items())}

    def forget_all_but(self, live: set[str]) -> None:
        for request_id in [r for r in self._accepted if r not in live]:
            del self._accepted[request_id]
