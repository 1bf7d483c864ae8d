"""The router's call into the routing policy: the pools' state in, a decision out.

``router/policy.py`` is the pure decision (workers' states and a request in, a
:class:`~router.policy.RouteDecision` out); this class feeds it the live views of the
pools and the round-robin cursor, turns "no healthy worker" into UNAVAILABLE, and, when
the request is traced, records in a ``route`` span what was chosen among what (each
candidate's score: docs/tracing.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.config import RouterConfig
from router.errors import ErrorCode, RouterError
from router.policy import NoHealthyWorker, RouteDecision, RouteRequest, route, scores
from router.request_trace import RequestTrace
from router.validation import ValidRequest
from router.workers import WorkerView
from workers.protocol.block_hashes import hash_prompt_blocks, salt_root


class Routing:
    """Routes requests over the router's pools (the lists are the router's own, live)."""

    def __init__(
        self, config: RouterConfig, prefill: Sequence[WorkerView], decode: Sequence[WorkerView]
    ):
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self._cursor = 0

    def route(
        self,
        trace: RequestTrace,
        valid: ValidRequest,
        token_ids: list[int],
        disaggregation: str | None = None,
    ) -> RouteDecision:
        """Where ``token_ids`` go: the request's own ``disaggregation`` unless one is given
        (a migration's). Raises UNAVAILABLE when a pool it needs has no healthy worker."""
        cfg = self.config
        disaggregation = disaggregation or valid.disaggregation or cfg.disaggregation
        request = RouteRequest(
            num_prompt_tokens=len(token_ids),
            block_hashes=tuple(
                hash_prompt_blocks(token_ids, cfg.block_size, salt_root(valid.params.cache_salt))
            ),
            block_size=cfg.block_size,
            weights=cfg.kv_weights,
        )
        with trace.span("route") as span:
            prefill = [v.state() for v in self.prefill]
            decode = [v.state() for v in self.decode]
            try:
                decision = route(
                    request,
                    prefill,
                    decode,
                    policy=cfg.policy,  # type: ignore[arg-type]
                    disaggregation=disaggregation,  # type: ignore[arg-type]
                    auto_local_prefill_tokens=cfg.auto_local_prefill_tokens,
                    saturated_queue=cfg.saturated_queue,
                    cursor=self._cursor,
                )
            except NoHealthyWorker as exc:
                raise RouterError(ErrorCode.UNAVAILABLE, str(exc)) from None
            self._cursor = decision.round_robin_cursor
            if span is not None:  # traced: what was chosen among what (computed if kept)
                fed = decision.prefill is not None  # the decode worker receives, computes none
                policy = cfg.policy
                chosen = {
                    "baton.route.policy": policy,
                    "baton.route.disaggregation": disaggregation,
                    "baton.route.decode": decision.decode,
                    "baton.route.prefill": decision.prefill or "",
                    "baton.route.cached_tokens": decision.cached_tokens,
                }
                span.set_attributes(chosen)
                span.set_lazy_attributes(
                    lambda: {
                        "baton.route.decode_scores": scores(
                            policy,  # type: ignore[arg-type]
                            decode,
                            request,
                            prefills=not fed,
                        ),
                        "baton.route.prefill_scores": scores(policy, prefill, request),  # type: ignore[arg-type]
                    }
                )
        return decision
