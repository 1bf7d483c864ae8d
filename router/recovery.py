"""Bringing a dead worker back: when to restart it, how often to try, when to give up.

When the router declares a worker dead (its event channel closed, or its engine loop
failed), it is out of routing and its requests have migrated to other workers
(``router/migration.py``).
:class:`Recovery` then asks the cluster's :class:`Restarter` for a fresh replica under the
same name and hands it to the router (``Router.replace_worker``), which routes to it
again once it has reported healthy. A failed attempt is retried after a backoff that
doubles, up to ``RestartPolicy.max_attempts``; after that the worker stays out of routing
and an error says so. Nothing is restarted while the router drains or after it stopped,
and ``stop`` cancels the attempts in progress (the cluster removes what they placed).

The router does not know Ray: ``cluster/restart.py`` implements the Restarter, and tests
pass a fake.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from router.workers import WorkerClient

logger = logging.getLogger(__name__)


class Restarter(Protocol):
    async def restart(self, name: str) -> WorkerClient:
        """Cluster side, called by the router: replace worker ``name``'s replica (what is
        left of the dead one goes first) with a fresh one of the same spec, introduced to
        its KV peers. Returns its client, not yet started. Raises on failure, leaving
        nothing of the attempt running. Must not block the event loop."""


@dataclass(frozen=True)
class RestartPolicy:
    max_attempts: int = 4  # per death; a successful restart starts the count again
    backoff_s: float = 1.0  # wait before the second attempt; doubles after each failure
    max_backoff_s: float = 30.0


class Recovery:
    """At most one restart task per worker; the router owns one of these."""

    def __init__(
        self,
        restarter: Restarter,
        replace: Callable[[str, WorkerClient], Awaitable[None]],
        is_closed: Callable[[], bool],
        policy: RestartPolicy,
    ):
        """``replace(name, client)`` swaps a started replacement in (the router's
        ``replace_worker``); ``is_closed()`` is true once no restart may start (drain, stop)."""
        self._restarter = restarter
        self._replace = replace
        self._is_closed = is_closed
        self.policy = policy
        self._tasks: dict[str, asyncio.Task] = {}
        self.num_restarts: dict[str, int] = {}  # successful restarts per worker (status)
        self.failed: set[str] = set()  # workers that stay out of routing
        # A replacement that died before its restart task ended: that task goes again.
        self._lost_again: set[str] = set()

    def is_restarting(self, name: str) -> bool:
        return name in self._tasks

    def worker_lost(self, name: str) -> None:
        """The router declared ``name`` dead: start its restart (on the event loop)."""
        if self._is_closed():
            logger.warning("worker %s is not restarted: the router is draining", name)
            return
        if name in self._tasks:
            self._lost_again.add(name)
            return
        self.failed.discard(name)
        task = asyncio.get_running_loop().create_task(self._run(name))
        self._tasks[name] = task
        task.add_done_callback(partial(self._forget, name))

    async def stop(self) -> None:
        """Cancel every restart in progress and wait until they have ended."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, name: str) -> None:
        try:
            while await self._recover(name) and name in self._lost_again:
                self._lost_again.discard(name)
        finally:
            # Now, not when the done callback runs: a death in between must start a task.
            self._forget(name, asyncio.current_task())
            self._lost_again.discard(name)

    def _forget(self, name: str, task: asyncio.Task | None) -> None:
        if self._tasks.get(name) is task:
            del self._tasks[name]

    async def _recover(self, name: str) -> bool:
        """Attempts until one succeeds (True) or the policy gives up (False)."""
        policy = self.policy
        delay = policy.backoff_s
        error = ""
        for attempt in range(1, policy.max_attempts + 1):
            if self._is_closed():
                return False
            try:
                client = await self._restarter.restart(name)
                await self._replace(name, client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                if attempt == policy.max_attempts:
                    break
                logger.warning(
                    "restart %d/%d of worker %s failed: %s; next in %g s",
                    *(attempt, policy.max_attempts, name, error, delay),
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, policy.max_backoff_s)
                continue
            self.num_restarts[name] = self.num_restarts.get(name, 0) + 1
            logger.warning("worker %s restarted (attempt %d)", name, attempt)
            return True
        if self._is_closed():
            return False
        self.failed.add(name)
        logger.error(
            "worker %s stays out of routing: %d restarts failed; last error: %s",
            *(name, policy.max_attempts, error),
        )
        return False
