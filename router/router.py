"""The disaggregated request flow: validate, route, hand off, stream, abort.

docs/serving.md ("A request") walks through it.

``Router.generate`` takes a typed :class:`~router.requests.GenerateRequest` and is an async
generator of :class:`~router.events.GenerateEvent`; errors are :class:`RouterError` with
an :class:`~router.errors.ErrorCode`. Front ends are thin adapters over it: the gRPC
servicer (``server.py``) converts protobuf to and from these types.

One request, disaggregated: submit ``prefill`` work to P; P's first event carries the
first token and a KV handle (P holds the blocks under a lease); the router streams the
first token at once and submits ``decode`` work with the handle to D, which pulls the KV
and streams the rest. Who must be told when the request ends early:

- before the handle reached D: P (its engine aborts the prefill, or frees the held
  blocks), and the lease is never read;
- after: D only (it stops or declines the transfer, whose notice frees P's blocks).

Each worker's batches are dispatched to the requests' queues as they arrive.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from functools import partial

from router.attempt import Attempts
from router.config import RouterConfig
from router.errors import ErrorCode, RouterError
from router.events import GenerateEvent
from router.group import RouterGroup
from router.metrics import MIGRATIONS
from router.migration import WorkerLost, check_limit, no_worker_left, reroute
from router.observer import Background, LoadObserver
from router.peer_prefix import PeerExports
from router.pending import SETTLE_TIMEOUT_S, Pending
from router.policy import RouteDecision
from router.quotas import QuotaConfig, QuotaExceeded, Quotas
from router.recovery import Recovery, Restarter, RestartPolicy
from router.request_trace import RequestTrace
from router.requests import GenerateRequest
from router.routing import Routing
from router.scaling import Provisioner, Scaling
from router.stream import RequestStream
from router.tracing import NO_TRACE, Tracing
from router.validation import InvalidRequest, ValidRequest, prompt_token_ids, validate
from router.workers import WorkerClient, WorkerView, abort_on, decline
from workers.protocol.wire import OutputBatch
from workers.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Router:
    """Admits, routes and hands off every request; dispatches the workers' events to them."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        prefill: Sequence[WorkerClient],
        decode: Sequence[WorkerClient],
        restarter: Restarter | None = None,
        restart_policy: RestartPolicy | None = None,
        tracing: Tracing | None = None,
        provisioner: Provisioner | None = None,
    ):
        """Without a ``restarter`` a dead worker stays out of routing for good; without
        ``tracing`` no request is traced (router/tracing.py); without a ``provisioner`` the
        pools keep their size (``scaling`` is None; router/scaling.py)."""
        self.config = config
        # The other router processes (router.processes > 1; ``join_group``). The workers'
        # id of a request starts with this process's prefix then: two processes never hand
        # a worker the same id, whatever ids their clients choose.
        self.group: RouterGroup | None = None
        self._id_prefix = ""
        self.tracing = tracing
        self.tokenizer = tokenizer
        self.prefill = [WorkerView(c) for c in prefill]
        self.decode = [WorkerView(c) for c in decode]
        self.is_draining = False
        self.is_stopped = False
        self.recovery: Recovery | None = None
        if restarter is not None:
            closed = partial(lambda r: r.is_draining or r.is_stopped, self)
            policy = restart_policy or RestartPolicy()
            self.recovery = Recovery(restarter, self.replace_worker, closed, policy)
        self._by_name = {v.name: v for v in [*self.prefill, *self.decode]}
        self._requests: dict[str, Pending] = {}
        self.routing = Routing(config, self.prefill, self.decode)
        self._background: set[asyncio.Task] = set()
        self.peers: PeerExports | None = None  # peer pull (G4), router/peer_prefix.py
        if config.peer_sharing:
            unread = partial(lambda r, h: decline(h, None, [*r.decode, *r.prefill]), self)
            self.peers = PeerExports(config.peer_export_timeout_s, unread, config.model_name)
        self.scaling: Scaling | None = None
        if provisioner is not None:
            args = (config.scale_down_grace_s, config.scale_max_replicas)
            self.scaling = Scaling(self, provisioner, *args)
        self.attempts = Attempts(config, self._by_name, self.prefill, self.decode, self.peers)
        # The SLA planner's feed and loop (cluster/planner_loop.py), when planner.enabled.
        self.observer: LoadObserver | None = None
        self.planner: Background | None = None
        self.quotas = Quotas(
            QuotaConfig(
                config.max_queued_requests,
                config.max_queued_share_per_key,
                config.requests_per_second_per_key,
                config.request_burst_per_key,
            )
        )

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self, ready_timeout_s: float = 120.0) -> None:
        """Open every worker's event channel, listen to each, wait until each has reported."""
        await asyncio.gather(*(v.client.start() for v in self._by_name.values()))
        for view in self._by_name.values():
            self._listen(view)
        deadline = time.monotonic() + ready_timeout_s
        while any(v.report is None and v.is_alive for v in self._by_name.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not report within the start-up timeout")
            await asyncio.sleep(0.05)
        if self.planner is not None:
            self.planner.start()

    async def stop(self) -> None:
        """Stop listening; restarts in progress are cancelled (the cluster cleans up)."""
        self.is_stopped = True
        if self.planner is not None:
            await self.planner.stop()
        if self.recovery is not None:
            await self.recovery.stop()
        if self.scaling is not None:
            await self.scaling.stop()
        for view in self._by_name.values():
            view.is_alive = False  # what follows (the channel closing) is no failure
            view.client.close()
        if self.tracing is not None:  # the kept traces go out (blocks while it sends)
            await asyncio.to_thread(self.tracing.shutdown)

    async def replace_worker(self, name: str, client: WorkerClient) -> None:
        """After a restart (``router/recovery.py``): ``client``, a fresh replica, takes dead
        worker ``name``'s place. Opens its event channel and listens; the policy routes to
        it once its first healthy report has come. Raises (the worker stays out) when the
        channel cannot be opened or the router drains."""
        view = self._by_name[name]
        if view.is_alive:
            raise RuntimeError(f"worker {name} is alive; only a dead worker is replaced")
        if not (self.is_draining or self.is_stopped):
            await client.start()
        if self.is_draining or self.is_stopped:
            client.close()
            raise RuntimeError("the router is draining")
        view.client.close()  # the dead one's channel, if it is still open
        view.client = client
        view.report, view.hashes, view.error = None, frozenset(), ""
        view.forget_all()  # their requests ended when the worker died
        view.is_alive = True
        self._listen(view)
        if self.group is not None:  # the other processes open their channels to it too
            await self.group.worker_joined(name, client.role)

    # Scaling's (router/scaling.py): a worker joins (routed to after its first healthy
    # report), a retired one leaves (its channel closes: no death), and past a drain's
    # grace a worker's requests migrate (router/migration.py), aborted there.
    async def add_worker(self, client: WorkerClient) -> WorkerView:
        await client.start()
        view = WorkerView(client)
        (self.prefill if client.role == "prefill" else self.decode).append(view)
        self._by_name[view.name] = view
        self._listen(view)
        if self.group is not None:
            await self.group.worker_joined(view.name, client.role)
        return view

    def join_group(self, group: RouterGroup) -> None:
        """Before ``start``: this is one of several router processes (router/group.py)."""
        self.group, self._id_prefix = group, group.id_prefix

    def worker(self, name: str) -> WorkerView | None:
        return self._by_name.get(name)

    def remove_worker(self, view: WorkerView) -> None:
        if self.group is not None:
            self.group.worker_left(view.name)
        view.is_alive = False
        view.client.close()
        pool = self.prefill if view.client.role == "prefill" else self.decode
        if view in pool:
            pool.remove(view)
        if self._by_name.get(view.name) is view:
            del self._by_name[view.name]
        if self.peers is not None:
            self.peers.worker_lost(view.name)

    def migrate_away(self, view: WorkerView, why: str) -> int:
        view.error = why
        moved = self._evict(view)
        for request_id in moved:
            self._spawn(abort_on(view, request_id))
        return len(moved)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests; wait up to ``grace_s`` for the running ones; abort the rest.

        Returns how many had to be aborted.
        """
        self.is_draining = True
        deadline = time.monotonic() + grace_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._requests)
        for request_id in left:
            await self.abort(request_id)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(left)

    # ---- requests --------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """Stream one request's events, the last with its Finish; raises RouterError.

        Closing the generator early (the client went away) aborts the request on its workers.
        """
        if self.is_draining:
            raise RouterError(ErrorCode.UNAVAILABLE, "the server is draining")
        request_id = req.request_id or uuid.uuid4().hex
        trace = self._trace(req, request_id)
        try:
            async for out in self._admit(req, request_id, trace):
                yield out
        except RouterError as exc:
            trace.fail(f"{exc.code.name}: {exc.message}")
            exc.trace_id = trace.trace_id
            raise
        except Exception as exc:
            trace.fail(exc)
            raise
        finally:
            trace.end()

    def _trace(self, req: GenerateRequest, request_id: str) -> RequestTrace:
        if self.tracing is None:
            return NO_TRACE  # type: ignore[return-value]
        return self.tracing.start(req, request_id, self.config.model_name)

    async def _admit(
        self, req: GenerateRequest, request_id: str, trace: RequestTrace
    ) -> AsyncIterator[GenerateEvent]:
        """Validate and admit the request, then stream it (``generate``'s body)."""
        # Ids are per caller: another caller's request under the same id is neither in the
        # way nor told of (its existence is not this caller's business).
        key = self._id_prefix + scoped_id(req.principal, request_id)
        if key in self._requests:
            raise RouterError(
                ErrorCode.INVALID_ARGUMENT, f"request_id: {request_id!r} is already in use"
            )
        cfg = self.config
        with trace.span("validate"):
            # Judged first (no tokenizer yet): a bad request is refused as such, even when
            # the router is full; then admission, before the tokenizer's work.
            valid = _checked(validate, req, cfg.model_name, request_id)
            try:
                self.quotas.admit(req.principal)
            except QuotaExceeded as exc:
                error = RouterError(ErrorCode.RESOURCE_EXHAUSTED, exc.message)
                error.retry_after_s = exc.retry_after_s
                raise error from None
            try:
                args = (valid, self.tokenizer, cfg.vocab_size, cfg.max_model_len)
                token_ids = _checked(prompt_token_ids, *args)
            except BaseException:
                self.quotas.release(req.principal)
                raise
        trace.set(**{"gen_ai.usage.input_tokens": len(token_ids)})
        stream = RequestStream(
            key,
            token_ids,
            valid.params,
            self.tokenizer,
            return_text=valid.return_text,
            return_timing=valid.return_timing,
            public_id=request_id,
        )
        pending = Pending(stream, trace)
        pending.principal = req.principal
        if cfg.request_timeout_s > 0:
            pending.deadline = asyncio.get_running_loop().time() + cfg.request_timeout_s
        if cfg.request_idle_timeout_s > 0:
            pending.idle_timeout_s = cfg.request_idle_timeout_s
        self._requests[key] = pending
        if self.observer is not None:
            self.observer.arrived(key, len(token_ids))
        settled = False
        try:
            async for out in self._run(pending, valid, token_ids):
                if out.finish is not None:
                    usage = out.finish.usage
                    trace.set(
                        **{
                            "gen_ai.response.finish_reasons": (out.finish.reason,),
                            "gen_ai.usage.output_tokens": usage.completion_tokens,
                            "baton.cached_tokens": usage.cached_prompt_tokens,
                            "baton.migrations": pending.num_migrations,
                        }
                    )
                yield out
            settled = True
        finally:
            if not settled:  # cancelled, deadline, or an error: stop it on the worker
                pending.is_aborted = True
                trace.event("abort")
            self._spawn(self._settle(pending))

    async def abort(self, request_id: str, principal: str | None = None) -> bool:
        """Abort a request in flight; False if there is none with that id. A client's
        abort (``principal``: who asks, router/auth.py) ends only its own requests, and
        another's answers False as if there were none (None: the router's own, drain, by
        the router's own id). With several router processes a client's abort that finds
        nothing here is asked of the others (``router.processes``; router/group.py)."""
        if await self.abort_here(request_id, principal):
            return True
        if principal is None or self.group is None:
            return False
        return await self.group.abort_elsewhere(request_id, principal)

    async def abort_here(self, request_id: str, principal: str | None = None) -> bool:
        """``abort`` in this router process only."""
        key = (
            request_id if principal is None else self._id_prefix + scoped_id(principal, request_id)
        )
        pending = self._requests.get(key)
        if pending is None or pending.stream.is_finished:
            return False
        if principal is not None and principal != pending.principal:
            return False
        pending.is_aborted = True
        await pending.events.put(("", None))  # wakes the stream, which ends with ABORT
        return True

    async def _run(
        self, pending: Pending, valid: ValidRequest, token_ids: list[int]
    ) -> AsyncIterator[GenerateEvent]:
        """The request on its workers; a lost worker's request migrates (router/migration.py)."""
        decision = self.routing.route(pending.trace, valid, token_ids)
        while True:
            try:
                async for out in self.attempts.run(pending, valid, token_ids, decision):
                    yield out
                return
            except WorkerLost as lost:
                decision = self._migrate(pending, valid, token_ids, lost)
                if decision is None:  # aborted meanwhile
                    yield pending.stream.abort_event()
                    return

    def _migrate(
        self, pending: Pending, valid: ValidRequest, token_ids: list[int], lost: WorkerLost
    ) -> RouteDecision | None:
        """Where the request continues after ``lost``; None if it was aborted meanwhile.
        Raises UNAVAILABLE past ``router.migration_limit`` or with nowhere to go."""
        stream = pending.stream
        handles = pending.migrated()
        if handles:  # P's KV that no decode worker will read now: free it
            self._spawn(decline(handles, None, self.decode))
        if (reserved := pending.take_reserved()) is not None:  # layer-wise: not needed now
            self._spawn(abort_on(reserved, stream.request_id))
        pending.num_migrations += 1
        check_limit(lost, pending.num_migrations, self.config.migration_limit)
        if pending.is_aborted:
            return None
        outputs = stream.output_token_ids
        pending.trace.event(
            "migration",
            **{
                "baton.worker.name": lost.worker,
                "baton.migration.cause": lost.cause,
                "baton.migration.error": lost.error,
                "baton.migration.output_tokens": len(outputs),
            },
        )
        try:
            route_again = partial(self.routing.route, pending.trace, valid)
            decision = reroute(route_again, token_ids, outputs)
        except RouterError as exc:
            raise no_worker_left(lost, exc.message) from None
        MIGRATIONS.labels("router", self.config.model_name, "router", lost.cause).inc()
        logger.warning(
            "%s: worker %s lost (%s: %s); migrating to %s after %d tokens (%d/%d)%s",
            *(stream.request_id, lost.worker, lost.cause, lost.error, decision.decode),
            *(len(outputs), pending.num_migrations, self.config.migration_limit),
            f" [trace {pending.trace.trace_id}]" if pending.trace.trace_id else "",
        )
        return decision

    async def _settle(self, pending: Pending) -> None:
        """After the client's stream ended: the worker side too; then the id is free."""
        try:
            await pending.settle(self.decode)
        finally:
            stream = pending.stream
            self._requests.pop(stream.request_id, None)
            self.quotas.release(pending.principal)
            if self.observer is not None:
                self.observer.ended(
                    stream.request_id, stream.num_output_tokens, stream.num_cached_tokens
                )

    def _spawn(self, coro) -> None:
        """A background task, referenced until done (asyncio keeps only weak references)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- workers ---------------------------------------------------------------------
    def _listen(self, view: WorkerView) -> None:
        # Bound to this client: a replaced worker's late frames and death are not its own.
        client = view.client
        client.listen(
            partial(self._on_batch, view, client), partial(self._worker_died, view, client)
        )

    def _on_batch(self, view: WorkerView, client: WorkerClient, batch: OutputBatch) -> None:
        if not view.is_alive or view.client is not client:
            return
        view.update(batch.report, batch.events)
        if self.observer is not None:
            self.observer.batch(view, batch)
        for event in batch.events:
            pending = self._requests.get(event.request_id)
            if pending is not None:
                pending.events.put_nowait((view.name, event))
            elif self.peers is not None and self.peers.on_event(view.name, event):
                pass  # a peer export's handles (router/peer_prefix.py)
            elif event.kv_handles:
                # Its request is gone (aborted while prefilling): free the held KV.
                self._spawn(decline(event.kv_handles, None, self.decode))
        if batch.report.error:
            self._worker_died(view, client, batch.report.error)

    def _worker_died(self, view: WorkerView, client: WorkerClient, error: str) -> None:
        if not view.is_alive or view.client is not client:
            return
        logger.error("worker %s is gone: %s", view.name, error)
        view.is_alive = False
        view.error = error
        self._evict(view)
        view.forget_all()
        if self.peers is not None:
            self.peers.worker_lost(view.name)
        if self.scaling is not None and self.scaling.owns(view.name):
            return  # joining or draining: scaling retires it, no restart
        if self.recovery is not None:
            self.recovery.worker_lost(view.name)

    def _evict(self, view: WorkerView) -> list[str]:
        """Wake the requests ``view`` runs with its loss: each migrates (router/migration.py)."""
        moved = []
        for request_id in list(view.active):
            pending = self._requests.get(request_id)
            if pending is not None and pending.owner is view:
                pending.events.put_nowait((view.name, None))
                moved.append(request_id)
        return moved


def scoped_id(principal: str, request_id: str) -> str:
    """The router's and the workers' id of a caller's request: the caller's own id, under
    its key's name when keys are configured (router/auth.py), so that two callers' ids
    never meet."""
    return f"{principal}/{request_id}" if principal else request_id


def _checked(check, *args):
    """``check(*args)``, its InvalidRequest as INVALID_ARGUMENT."""
    try:
        return check(*args)
    except InvalidRequest as exc:
        raise RouterError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
