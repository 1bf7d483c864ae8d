"""What other threads ask of a worker's engine loop (``EngineService``), one type each.

The engine is not thread-safe, so the router's calls and the KV connector's news are
queued as these messages and run by the loop thread between engine steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workers.protocol.wire import OutputBatch, WorkItem

Sink = Callable[[OutputBatch], None]


@dataclass(frozen=True)
class Submit:
    """Router: admit a request (prefill, decode with P's handles, or full)."""

    item: WorkItem
    router: int = 0  # the router process whose event channel gets its events


@dataclass(frozen=True)
class Abort:
    """Router: end a request early (its final event says ABORT)."""

    request_id: str


@dataclass(frozen=True)
class Decline:
    """Router, on a decode worker: nothing will read these handles; P frees their blocks."""

    handles: tuple[bytes, ...]


@dataclass(frozen=True)
class Attach:
    """Router: push every batch of events (and the heartbeat report) into ``sink``."""

    sink: Sink
    router: int = 0  # which router process's channel (one sink each)


@dataclass(frozen=True)
class LeaseEnded:
    """KV connector, on a prefill worker: the request's lease ended on every rank."""

    request_id: str
    reason: str  # the notice's status, "expired", "no_readers" or "shutdown"


Command = Submit | Abort | Decline | Attach | LeaseEnded
