"""The router's side of its workers: the client Protocol and what it last heard from each.

The router never calls Ray itself: ``cluster/`` hands it one :class:`WorkerClient` per
worker (``workers.ray_worker.RayWorkerClient`` in production, in-process services in
tests). Each worker pushes its token events and :class:`~workers.wire.WorkerReport` to the
router, which dispatches them as they arrive (``Router._on_batch``);
:class:`WorkerView` keeps the latest report and the worker's cached block hashes for the
routing policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.policy import WorkerState
from workers.wire import OutputBatch, WorkerReport, WorkItem


class WorkerClient(Protocol):
    name: str
    role: str  # prefill | decode

    async def submit(self, item: WorkItem) -> None:
        """Queue a request on the worker; raises when the worker refuses or is gone."""

    async def abort(self, request_id: str) -> None:
        """Abort a request on the worker (its final event follows); unknown ids are ignored."""

    async def decline(self, handles: tuple[bytes, ...]) -> None:
        """Decode workers: release a prefill worker's held KV that will never be read."""

    async def start(self) -> None:
        """Open the worker's event channel; raises when the worker cannot be reached."""

    def listen(
        self, on_batch: Callable[[OutputBatch], None], on_lost: Callable[[str], None]
    ) -> None:
        """Call ``on_batch`` (on the event loop) with each batch of token events and the
        worker's report, and ``on_lost`` once, with why, when the worker is gone."""

    def close(self) -> None:
        """Close the event channel."""


@dataclass
class WorkerView:
    client: WorkerClient
    report: WorkerReport | None = None
    hashes: frozenset[int] = frozenset()
    is_alive: bool = True
    error: str = ""  # why the worker was declared dead
    active: set[str] = field(default_factory=set)  # request ids sent and not yet finished

    @property
    def name(self) -> str:
        return self.client.name

    def update(self, report: WorkerReport) -> None:
        if report.cached_hashes is not None:
            self.hashes = frozenset(report.cached_hashes)
        self.report = report

    @property
    def is_healthy(self) -> bool:
        return self.is_alive and self.report is not None and self.report.healthy

    def state(self) -> WorkerState:
        """The policy's view: the worker's report, plus what the router sent since."""
        report = self.report
        used = report.kv_blocks_used / report.kv_blocks_total if report else 0.0
        return WorkerState(
            name=self.name,
            healthy=self.is_healthy,
            # The router's own count is fresher than the last report under a burst.
            num_running=max(len(self.active), report.num_running if report else 0),
            num_waiting=report.num_waiting if report else 0,
            kv_usage=used,
            cached_hashes=self.hashes,
        )
