"""The planner's side effect, behind one Protocol: a :class:`Scaler` sets the pools' sizes.

``Planner.tick`` decides ``(prefill, decode)``; a Scaler makes the cluster so. Two exist:

- the router's live scaling (``router/scaling.py``'s ``Scaling``, on Ray through
  ``cluster/scaling.py``): new workers placed, introduced to their KV peers and routed to
  after their first healthy report; removed ones drained (their requests finish, or
  migrate with their tokens past ``router.scale_down_grace_seconds``) and stopped;
- :class:`VirtualScaler` here: counts only, in-process, for the planner's tests and
  simulations (a change takes effect at once, or after ``delay_s`` of a given clock).

This package imports nothing else of the project, so the router's Scaling satisfies the
Protocol structurally (``tests/router/test_scaling.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class Scaler(Protocol):
    def current(self) -> tuple[int, int]:
        """The pools' sizes now, (prefill, decode): workers joining or serving (draining
        ones not counted)."""

    async def scale_to(self, prefill: int, decode: int):
        """Move the pools to these sizes; returns once done. Raises when refused (a pool
        below 1, more than the cluster has room for, the router draining)."""


@dataclass
class VirtualScaler:
    """A Scaler of counts: ``scale_to`` records the call and, ``delay_s`` later by ``clock``
    (0: at once), ``current`` says so; bounds as the router's (>= 1 per pool, at most
    ``max_workers`` together)."""

    prefill: int = 1
    decode: int = 1
    max_workers: int = 8
    delay_s: float = 0.0
    clock: Callable[[], float] = field(default=lambda: 0.0)
    calls: list[tuple[int, int]] = field(default_factory=list)
    _pending: tuple[float, int, int] | None = None

    def current(self) -> tuple[int, int]:
        if self._pending is not None and self.clock() >= self._pending[0]:
            _, self.prefill, self.decode = self._pending
            self._pending = None
        return self.prefill, self.decode

    async def scale_to(self, prefill: int, decode: int) -> tuple[int, int]:
        if prefill < 1 or decode < 1:
            raise ValueError(f"each pool keeps at least one worker, got ({prefill}, {decode})")
        if prefill + decode > self.max_workers:
            raise ValueError(f"{prefill} + {decode} workers is above {self.max_workers}")
        self.calls.append((prefill, decode))
        self._pending = (self.clock() + self.delay_s, prefill, decode)
        return self.current()
