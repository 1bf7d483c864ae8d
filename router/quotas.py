"""Admission per caller: one key's overload must not take the others' service (docs/security.md).

Checked when a request arrives, before it is validated or tokenized (the work a refusal
should not cost): the router's whole admission bound (``router.max_queued_requests``), a
key's share of it (``router.max_queued_share_per_key``) and, when set, a key's request rate
(``router.requests_per_second_per_key``, a token bucket with a burst of
``router.request_burst_per_key``). A refusal is RESOURCE_EXHAUSTED (HTTP 429) naming the
limit, with the seconds after which a retry can pass (``Retry-After``). Without keys every
request is the same caller (""), so only the whole bound and the rate apply.

Pure bookkeeping: the router calls :meth:`admit` and :meth:`release` on its event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


class QuotaExceeded(Exception):
    """Refused for now: ``message`` names the limit; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class QuotaConfig:
    max_queued_requests: int = 1024
    share_per_key: float = 1.0  # of max_queued_requests one key may hold; 1 = no own bound
    rate_per_key: float = 0.0  # requests per second per key; 0 = no rate limit
    burst_per_key: int = 16  # requests a key may send at once beyond its rate


class Quotas:
    def __init__(self, config: QuotaConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self.total = 0

    @property
    def per_key_limit(self) -> int:
        cfg = self.config
        return max(1, math.floor(cfg.max_queued_requests * cfg.share_per_key))

    def in_flight(self, key: str) -> int:
        return self._in_flight.get(key, 0)

    def check(self, key: str) -> None:
        """Raise :class:`QuotaExceeded` if one more request of ``key`` would be refused now;
        counts nothing. For work a refusal should not cost that comes before :meth:`admit`
        (rendering a chat template); :meth:`admit` still decides."""
        cfg = self.config
        # The key's own share first: a key at its share is refused for that, even when the
        # whole bound is full too (it is full then partly because of this key).
        held = self._in_flight.get(key, 0)
        if key and held >= self.per_key_limit:
            raise QuotaExceeded(
                f"key {key!r} has {held} requests in flight (router.max_queued_share_per_key="
                f"{cfg.share_per_key} of {cfg.max_queued_requests}); retry later",
                1.0,
            )
        if self.total >= cfg.max_queued_requests:
            raise QuotaExceeded(
                f"{self.total} requests in flight (router.max_queued_requests="
                f"{cfg.max_queued_requests}); retry later",
                1.0,
            )
        if cfg.rate_per_key > 0:
            tokens = self._tokens(key, self._clock())
            if tokens < 1.0:
                wait = (1.0 - tokens) / cfg.rate_per_key
                who = f"key {key!r}" if key else "this server"
                raise QuotaExceeded(
                    f"{who} is over {cfg.rate_per_key:g} requests per second "
                    f"(router.requests_per_second_per_key); retry in {wait:.2f} s",
                    wait,
                )

    def admit(self, key: str) -> None:
        """Count one more request of ``key``, or raise :class:`QuotaExceeded`."""
        self.check(key)
        if self.config.rate_per_key > 0:
            now = self._clock()
            self._buckets[key] = (self._tokens(key, now) - 1.0, now)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        self.total += 1

    def release(self, key: str) -> None:
        """One request of ``key`` ended (every path: finish, abort, error)."""
        held = self._in_flight.get(key, 0) - 1
        if held > 0:
            self._in_flight[key] = held
        else:
            self._in_flight.pop(key, None)
        self.total = max(0, self.total - 1)

    def _tokens(self, key: str, now: float) -> float:
        """``key``'s bucket refilled to ``now`` (a new key starts with its whole burst)."""
        cfg = self.config
        tokens, at = self._buckets.get(key, (float(cfg.burst_per_key), now))
        return min(float(cfg.burst_per_key), tokens + (now - at) * cfg.rate_per_key)
