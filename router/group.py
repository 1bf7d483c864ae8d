"""What a router process asks of the others (``router.processes`` > 1).

N router processes serve the same ports and the same worker pools (docs/serving.md,
"Several router processes"). Each is a whole :class:`~router.router.Router`: it admits,
routes and streams its own requests, and every worker pushes to each process its own
requests' events and every report (``workers/serving/sinks.py``), so each sees every
worker's load and cache. What crosses processes is small and per request, never per
token: a client's abort that lands on another process than its stream, and (from the
first process, which owns the workers' lifecycle on Ray) the news that a worker joined or
left. ``cluster/router_hub.py`` implements this Protocol in the first process,
``cluster/router_process.py`` in the others.
"""

from __future__ import annotations

from typing import Protocol


class RouterGroup(Protocol):
    id_prefix: str  # this process's prefix of its workers' request ids ("r0:", "r1:", ...)

    async def abort_elsewhere(self, request_id: str, principal: str) -> bool:
        """A client's abort that found nothing here: ask the other processes; True if one
        of them had the caller's request (and aborted it)."""

    async def worker_joined(self, name: str, role: str) -> None:
        """First process: a worker started or was replaced (it has opened its channel to
        this process); the others open theirs to it before this returns. Others: no-op."""

    def worker_left(self, name: str) -> None:
        """First process: a worker was retired (live scaling); the others drop it too."""
