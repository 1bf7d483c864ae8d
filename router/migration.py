"""Request migration: a request whose worker is lost continues on another worker.

When the worker serving a request dies (its event channel closed, its engine loop or a
rank of its replica failed), refuses the submit, or fails the request through no fault
of the request's own (a KV transfer, an offer), :class:`~router.pending.Pending` raises
:class:`WorkerLost` instead of failing the client's stream. The router then resends the
request elsewhere (``Router._run``; where to: ``reroute``):

- no output streamed yet (the prefill, or a hand-off before the first token went out):
  routed again as new, by the configured policy (falling back to prefill on a decode
  worker when no prefill worker is left);
- output streamed: to a decode worker, ``full``, with the prompt and the output so far
  (``WorkItem.output_token_ids``); the worker recomputes their KV (its prefix cache may
  hold some) and continues exactly where the client's stream stopped: the engine
  resumes the seeded generator, penalties and stop strings across the boundary
  (``workers/engine/resume.py``), and the router's own detokenizer and stop strings
  simply continue.

Each request migrates at most ``router.migration_limit`` times; past that (or with no
healthy worker to continue on) the client gets ``UNAVAILABLE`` naming the lost worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from router.errors import ErrorCode, RouterError
from router.policy import RouteDecision

Cause = Literal[
    "decode_worker_died",  # a decode worker (or a rank of its replica) died
    "prefill_worker_died",  # a prefill worker died before its hand-off completed
    "transfer_failed",  # the KV hand-off failed (kv_transfer.on_failure: fail) or P's offer
    "submit_failed",  # the worker refused the work, or is no longer healthy
]
CAUSES: tuple[Cause, ...] = (
    "decode_worker_died",
    "prefill_worker_died",
    "transfer_failed",
    "submit_failed",
)


class WorkerLost(Exception):
    """The request's current worker cannot finish it; the router may migrate it."""

    def __init__(self, worker: str, cause: Cause, error: str):
        super().__init__(f"worker {worker}: {error}")
        self.worker = worker
        self.cause = cause
        self.error = error


def died(role: str) -> Cause:
    """The cause for a worker of ``role`` that is gone."""
    return "prefill_worker_died" if role == "prefill" else "decode_worker_died"


def check_limit(lost: WorkerLost, num_migrations: int, limit: int) -> None:
    """Before migration number ``num_migrations`` (1, 2, ...): UNAVAILABLE past ``limit``."""
    if num_migrations > limit:
        num_done = num_migrations - 1
        done = (
            f"; migrated {num_done} time{'s' if num_done > 1 else ''} already" if num_done else ""
        )
        raise RouterError(
            ErrorCode.UNAVAILABLE,
            f"worker {lost.worker} failed ({lost.error}); not migrated "
            f"(router.migration_limit={limit}){done}",
        )


def no_worker_left(lost: WorkerLost, why: str) -> RouterError:
    """UNAVAILABLE: nowhere to migrate to."""
    return RouterError(
        ErrorCode.UNAVAILABLE,
        f"worker {lost.worker} failed ({lost.error}); cannot migrate: {why}",
    )


def reroute(
    route: Callable[[list[int], str | None], RouteDecision],
    token_ids: list[int],
    output_token_ids: list[int],
) -> RouteDecision:
    """Where a lost request continues (the rules above). ``route(token_ids,
    disaggregation)`` is the router's policy call (None: the request's own setting); its
    RouterError (no healthy worker to go to) propagates."""
    if output_token_ids:
        # Recomputed on a decode worker: the KV of the output so far is nowhere else.
        return route(token_ids + output_token_ids, "never")
    try:
        return route(token_ids, None)
    except RouterError:  # no prefill worker left: prefill on a decode worker
        return route(token_ids, "never")
