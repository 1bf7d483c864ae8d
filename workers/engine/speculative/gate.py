"""Which requests speculate this step: each where its own acceptance pays for what it costs.

A verify step that accepts ``a`` of a request's proposals gives that request ``1 + a``
tokens where a plain step gives one, and costs more: the draft's forwards and the target's
k extra rows. Measured per batch-size bucket (``switch.py``'s buckets), as moving averages
of the step's seconds (CPU seconds on CPU): ``plain`` for decode steps where nobody
verified, ``spec`` for steps where every decode did. Speculating pays for a request while

    a  >=  spec / plain - 1          (the break-even accepted count)

where ``a`` is the request's own moving average of accepted proposals per verify step,
starting from the average over all requests. (At batch 1 on the bench pair a verify step
costs ~1.3 plain ones: a request speculates while it averages 0.3 accepted proposals or
more; at batch 16 only requests well above the average do.)

A request below the line learns nothing new while it does not speculate, so each step it
sits out moves its average a step towards the average over all requests (acceptance comes
in stretches: an unpredictable stretch ends, and the request is tried again; a request that
stays unpredictable is pulled back down by each try). No fixed waits.

Until both costs of a bucket are measured the line is 0: everyone speculates, which
measures ``spec``; the bucket's switch (``switch.py``) measures ``plain``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ALPHA = 0.1  # weight of the newest observation: acceptance comes in bursts; ~10 steps of it


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


@dataclass
class _Costs:
    seconds: dict[bool, float] = field(default_factory=dict)  # all verified? -> step seconds


class AcceptanceGate:
    def __init__(self) -> None:
        self._costs: dict[int, _Costs] = {}
        self._accepted: dict[str, float] = {}  # request id -> accepted per verify step
        self._overall: float | None = None  # the same, over all requests (a new one's prior)

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
        costs = self._costs.setdefault(self.bucket(num_decodes), _Costs())
        everyone = num_verified == num_decodes
        costs.seconds[everyone] = _ewma(costs.seconds.get(everyone), seconds)

    def forget_all_but(self, live: set[str]) -> None:
        for request_id in [r for r in self._accepted if r not in live]:
            del self._accepted[request_id]
