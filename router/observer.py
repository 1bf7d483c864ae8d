"""What the router tells the SLA planner about its load: two small Protocols.

The planner (``cluster/planner_loop.py``, docs/planner.md) lives above the router: the
router only calls an :class:`LoadObserver`, if one is attached, at the three moments that
describe its load, and starts and stops a :class:`Background` loop with itself. Both are
called on the router's event loop and must not block it (the observer only appends to
its own records; the tick runs as its own task).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from workers.protocol.wire import OutputBatch

if TYPE_CHECKING:
    from router.workers import WorkerView


class LoadObserver(Protocol):
    def arrived(self, request_id: str, num_prompt_tokens: int) -> None:
        """A request was admitted (validated, tokenized) under ``request_id``, the id its
        token events carry."""

    def batch(self, worker: WorkerView, batch: OutputBatch) -> None:
        """A live worker's batch of token events and its report (one engine step's
        output, or a report alone), as it reached the router."""

    def ended(self, request_id: str, num_output_tokens: int, num_cached_tokens: int) -> None:
        """The request's stream ended (finished, failed or aborted)."""


class Background(Protocol):
    def start(self) -> None:
        """Start the loop's task (on the running event loop); the router has started."""

    async def stop(self) -> None:
        """Cancel the loop's task and wait for it; the router is stopping."""
