"""Which requests speculate this step: each where its own acceptance pays for what it costs.

A verify step that accepts ``a`` of a request's proposals gives that request ``1 + a``
tokens where a plain step gives one, and costs more: the draft's forwards and the target's
k extra rows. Measured per batch-size bucket (``switch.py``'s buckets), as moving averages
of the step's seconds (CPU seconds on CPU): ``plain`` for decode steps where nobody
verified, ``spec`` for steps where every decode did. Speculating pays for a request while

    a  >=  spec / plain - 1          (the break-even accepted count)

and ``a`` is the request's own moving average of accepted proposals per verify step,
starting from the average over all requests. (At batch 1 on the bench pair a verify step
costs ~1.6 plain ones: a request speculates while it averages 0.6 accepted proposals or
more; at batch 16 verifying is nearly 2.5x a plain step and only requests that average
1.5 or more do.) A request below the line is probed again after 1, 2, 4 ... up to 16
skipped steps, so a request whose text turns predictable starts again; a probe that pays
resets the wait.

Until both costs of a bucket are measured the line is 0: everyone speculates, which
measures ``spec``; the bucket's switch (``switch.py``) measures ``plain``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ALPHA = 0.1  # weight of the newest observation: acceptance comes in bursts; ~10 steps of it
_MAX_WAIT = 16  # most steps a request below the line skips before it is probed again


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


@dataclass
class _Costs:
    seconds: dict[bool, float] = field(default_factory=dict)  # all verified? -> step seconds


@dataclass
class _Waiting:
    left: int  # steps still to skip
    wait: int  # this wait's length (doubles after a probe that does not pay)


class AcceptanceGate:
    def __init__(self) -> None:
        self._costs: dict[int, _Costs] = {}
        self._accepted: dict[str, float] = {}  # request id -> accepted per verify step
        self._overall: float | None = None  # the same, over all requests (a new one's prior)
        self._waiting: dict[str, _Waiting] = {}

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return num_decodes.bit_length()

    def break_even(self, num_decodes: int) -> float:
        """Accepted proposals per verify step a request needs for speculation to pay at
        this batch size (0 until both step costs are measured)."""
        costs = self._costs.get(self.bucket(num_decodes))
        if costs is None or len(costs.seconds) < 2:
            return 0.0
        return max(0.0, costs.seconds[True] / costs.seconds[False] - 1.0)

    def allows(self, request_id: str, num_decodes: int) -> bool:
        """Whether this request speculates in a step of ``num_decodes`` decodes."""
        waiting = self._waiting.get(request_id)
        if waiting is not None and waiting.left > 0:
            waiting.left -= 1
            return False
        estimate = self._accepted.get(request_id, self._overall)
        if estimate is None or waiting is not None:  # nothing known yet, or a probe
            return True
        if estimate >= self.break_even(num_decodes):
            return True
        self._waiting[request_id] = _Waiting(left=0, wait=1)
        return False

    def record(self, request_id: str, num_accepted: int, num_decodes: int) -> None:
        """A verify step accepted ``num_accepted`` of the request's proposals."""
        estimate = _ewma(self._accepted.get(request_id, self._overall), num_accepted)
        self._accepted[request_id] = estimate
        self._overall = _ewma(self._overall, num_accepted)
        waiting = self._waiting.get(request_id)
        if estimate >= self.break_even(num_decodes):
            self._waiting.pop(request_id, None)
        elif waiting is None:
            self._waiting[request_id] = _Waiting(left=1, wait=1)
        else:
            waiting.wait = min(2 * waiting.wait, _MAX_WAIT)
            waiting.left = waiting.wait

    def observe(self, num_decodes: int, num_verified: int, seconds: float) -> None:
        """A decode-only step of ``num_decodes`` requests, ``num_verified`` of them verify
        chunks, took ``seconds`` (mixed steps say nothing about either cost)."""
        if num_decodes < 1 or seconds <= 0 or 0 < num_verified < num_decodes:
            return
        costs = self._costs.setdefault(self.bucket(num_decodes), _Costs())
        everyone = num_verified == num_decodes
        costs.seconds[everyone] = _ewma(costs.seconds.get(everyone), seconds)

    def forget_all_but(self, live: set[str]) -> None:
        for table in (self._accepted, self._waiting):
            for request_id in [r for r in table if r not in live]:
                del table[request_id]
