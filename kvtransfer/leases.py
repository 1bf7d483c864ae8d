"""Leases: the source side's hold on a request's blocks while peers read them.

The prefill side (the owner of the source blocks) must not free a request's blocks
while a decode rank may still read them (pull) or while its own write into a decode
rank's blocks is in flight (push). A lease ends, and the worker's ``on_release``
callback frees the blocks, exactly once, when

- every expected reader has sent its completion notice (done, aborted, skipped or
  failed: any of them means "I no longer touch your blocks"), or
- the lease expires (the reader vanished, or never got the handle), but never while
  one of our own writes from these blocks is in flight (push); expiry then waits for
  the write to end, which has its own deadline.

Late and duplicate notices find no lease, or a reader already counted, and do
nothing. Pure bookkeeping with an injectable clock; the connector drives it from its
thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ReleaseCallback = Callable[[str, str], None]  # (req_id, reason)


@dataclass
class Lease:
    req_id: str
    lease_id: int
    block_ids: tuple[int, ...]
    num_readers: int
    expires_at: float
    finished_readers: set[str] = field(default_factory=set)
    num_writes_in_flight: int = 0


class LeaseTable:
    def __init__(self, on_release: ReleaseCallback, clock: Callable[[], float] = time.monotonic):
        self._on_release = on_release
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def add(
        self, req_id: str, block_ids: tuple[int, ...], num_readers: int, lease_seconds: float
    ) -> Lease:
        """Start holding ``block_ids`` for ``num_readers`` readers (0: released at once)."""
        lease = Lease(
            req_id=req_id,
            lease_id=self._next_id,
            block_ids=block_ids,
            num_readers=num_readers,
            expires_at=self._clock() + lease_seconds,
        )
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        if num_readers == 0:
            self._release(lease, "no_readers")
        return lease

    def reader_finished(self, lease_id: int, reader: str, status: str) -> bool:
        """A reader is done with the lease; returns True when this released it."""
        lease = self._leases.get(lease_id)
        if lease is None or reader in lease.finished_readers:
            return False  # late or duplicate notice: harmless
        lease.finished_readers.add(reader)
        if len(lease.finished_readers) >= lease.num_readers and not lease.num_writes_in_flight:
            self._release(lease, status)
            return True
        return False

    def end(self, lease_id: int, reason: str) -> bool:
        """The owner itself ends the lease (no reader will come); False if unknown, or if
        a write from it is in flight (a reader has it: its end releases the lease)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.num_writes_in_flight:
            return False
        self._release(lease, reason)
        return True

    def write_started(self, lease_id: int) -> Lease | None:
        """Our own write from the lease's blocks begins (push); defers expiry."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.num_writes_in_flight += 1
        return lease

    def write_ended(self, lease_id: int, reader: str, status: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        lease.num_writes_in_flight -= 1
        lease.finished_readers.add(reader)
        if lease.num_writes_in_flight:
            return
        if len(lease.finished_readers) >= lease.num_readers:
            self._release(lease, status)
        elif self._clock() >= lease.expires_at:
            self._release(lease, "expired")

    def expire(self) -> list[str]:
        """Release every expired lease that has no write in flight; returns their req ids."""
        now = self._clock()
        expired = [
            lease
            for lease in self._leases.values()
            if now >= lease.expires_at and not lease.num_writes_in_flight
        ]
        for lease in expired:
            self._release(lease, "expired")
        return [lease.req_id for lease in expired]

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self._leases.values()), default=None)

    def release_all(self, reason: str) -> None:
        """Shutdown: the worker takes its blocks back (no peer may read them any more)."""
        for lease in list(self._leases.values()):
            self._release(lease, reason)

    def _release(self, lease: Lease, reason: str) -> None:
        del self._leases[lease.lease_id]
        try:
            self._on_release(lease.req_id, reason)
        except Exception:  # the worker's bug must not stop the other leases' releases
            logger.exception("on_release(%r, %r) failed", lease.req_id, reason)
