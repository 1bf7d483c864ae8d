"""Request migration: a request whose worker is lost continues on another worker.

When the worker serving a request dies (its event channel closed, its engine loop or a
rank of its replica failed), refuses the submit, or fails the request through no fault
of the request's own (a KV transfer, an offer: :func:`failure`), the request's
:class:`~router.lifecycle.RequestLife` raises :class:`WorkerLost` instead of failing the
client's stream, goes ``migrating`` and resends the request elsewhere (where to:
``reroute``):

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

import logging
import uuid
from collections.abc import Callable
from typing import Literal

from router.config import RouterConfig
from router.errors import ErrorCode, RouterError
from router.metrics import MIGRATIONS
from router.policy import RouteDecision
from router.request_trace import RequestTrace
from router.stream import RequestStream
from workers.protocol.wire import TokenEvent

logger = logging.getLogger(__name__)

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


def failure(
    request_id: str, worker: str, role: str, is_alive: bool, event: TokenEvent
) -> WorkerLost | RouterError | None:
    """What a worker's final event with an error means for the request: WorkerLost (it
    migrates) when it failed through no fault of its own, a RouterError (INTERNAL, to
    the client) otherwise; None without an error."""
    if not event.error:
        return None
    if event.is_retryable:
        # Its engine loop died (the report that says so came with it), or a KV transfer
        # failed: not the request's fault.
        return WorkerLost(worker, "transfer_failed" if is_alive else died(role), event.error)
    # The worker's text may hold internals (paths, addresses, another request's data): it
    # goes to the log, the client gets an id to quote.
    error_id = uuid.uuid4().hex
    logger.error(
        "request %s failed on worker %s [error %s]: %s", request_id, worker, error_id, event.error
    )
    return RouterError(
        ErrorCode.INTERNAL,
        f"the request failed on a worker (error {error_id}; the server's log has the details)",
    )


def next_route(
    lost: WorkerLost,
    num_migrations: int,
    config: RouterConfig,
    route: Callable[[list[int], str | None], RouteDecision],
    token_ids: list[int],
    stream: RequestStream,
    trace: RequestTrace,
    is_aborted: bool,
) -> RouteDecision | None:
    """Migration number ``num_migrations`` (1, 2, ...) of the request ``stream`` streams:
    where it continues (``reroute``), traced, counted and logged; None when it was aborted
    meanwhile. UNAVAILABLE past ``router.migration_limit`` or with nowhere to go."""
    check_limit(lost, num_migrations, config.migration_limit)
    if is_aborted:
        return None
    outputs = stream.output_token_ids
    trace.event(
        "migration",
        **{
            "baton.worker.name": lost.worker,
            "baton.migration.cause": lost.cause,
            "baton.migration.error": lost.error,
            "baton.migration.output_tokens": len(outputs),
        },
    )
    try:
        decision = reroute(route, token_ids, outputs)
    except RouterError as exc:
        raise no_worker_left(lost, exc.message) from None
    MIGRATIONS.labels("router", config.model_name, "router", lost.cause).inc()
    logger.warning(
        "%s: worker %s lost (%s: %s); migrating to %s after %d tokens (%d/%d)%s",
        *(stream.request_id, lost.worker, lost.cause, lost.error, decision.decode),
        *(len(outputs), num_migrations, config.migration_limit),
        f" [trace {trace.trace_id}]" if trace.trace_id else "",
    )
    return decision
