"""The router: its workers, and every request's admission, from ``generate`` to settled.

docs/serving.md ("A request") walks through it.

``Router.generate`` takes a typed :class:`~router.requests.GenerateRequest` and is an async
generator of :class:`~router.events.GenerateEvent`; errors are :class:`RouterError` with
an :class:`~router.errors.ErrorCode`. Front ends are thin adapters over it: the gRPC
servicer (``server.py``) and the HTTP app (``http/``) convert their wire types to and
from these.

The router admits a request (``router/admission.py``) and gives it a
:class:`~router.lifecycle.RequestLife`, the one owner of the request from then on: it
routes, submits, hands the KV off, migrates, and settles (its docstring is the table of
states and of who must be told when the request ends in each). The router's part is the
workers' side: it opens each worker's event channel, dispatches each batch's events to
their requests' inboxes as they arrive, tells the requests a worker runs that it is lost
(``RequestLife.lose``: they migrate), and keeps the pools (restarts, live scaling, the
other router processes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from functools import partial

from router.admission import admit, quotas_of, scoped_id
from router.config import RouterConfig
from router.errors import ErrorCode, RouterError
from router.events import GenerateEvent
from router.group import RouterGroup
from router.holdings import SETTLE_TIMEOUT_S
from router.lifecycle import RequestLife, RouterSide
from router.observer import Background, LoadObserver
from router.peer_prefix import PeerExports
from router.recovery import Recovery, Restarter, RestartPolicy
from router.request_trace import RequestTrace
from router.requests import GenerateRequest
from router.routing import Routing
from router.scaling import Provisioner, Scaling
from router.stream import RequestStream
from router.tracing import NO_TRACE, Tracing
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
        self._requests: dict[str, RequestLife] = {}
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
        # What each request's life uses of the router (its pools are live lists).
        pools = (self._by_name, self.prefill, self.decode, self.peers, self._spawn)
        self._side = RouterSide(config, self.routing, *pools)
        # The SLA planner's feed and loop (cluster/planner_loop.py), when planner.enabled.
        self.observer: LoadObserver | None = None
        self.planner: Background | None = None
        self.quotas = quotas_of(config)

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
        life = None
        is_cut_short = True
        try:
            life = self._admit(req, request_id, trace)
            async for out in life.run():
                yield out
            is_cut_short = False
        except RouterError as exc:
            trace.fail(f"{exc.code.name}: {exc.message}")
            exc.trace_id = trace.trace_id
            raise
        except Exception as exc:
            trace.fail(exc)
            raise
        finally:
            if life is not None:
                self._ended(life, is_cut_short)
            trace.end()

    def _trace(self, req: GenerateRequest, request_id: str) -> RequestTrace:
        if self.tracing is None:
            return NO_TRACE  # type: ignore[return-value]
        return self.tracing.start(req, request_id, self.config.model_name)

    def _admit(self, req: GenerateRequest, request_id: str, trace: RequestTrace) -> RequestLife:
        """Validate and admit the request (router/admission.py); its life, registered."""
        # Ids are per caller: another caller's request under the same id is neither in the
        # way nor told of (its existence is not this caller's business).
        key = self._id_prefix + scoped_id(req.principal, request_id)
        if key in self._requests:
            raise RouterError(
                ErrorCode.INVALID_ARGUMENT, f"request_id: {request_id!r} is already in use"
            )
        cfg = self.config
        valid, token_ids = admit(req, request_id, cfg, self.tokenizer, self.quotas, trace)
        stream = RequestStream(
            key,
            token_ids,
            valid.params,
            self.tokenizer,
            return_text=valid.return_text,
            return_timing=valid.return_timing,
            public_id=request_id,
        )
        loop_time = asyncio.get_running_loop().time()
        life = RequestLife(
            self._side,
            stream,
            trace,
            valid,
            token_ids,
            self._settled,
            principal=req.principal,
            deadline=loop_time + cfg.request_timeout_s if cfg.request_timeout_s > 0 else math.inf,
            idle_timeout_s=cfg.request_idle_timeout_s or math.inf,
        )
        self._requests[key] = life
        if self.observer is not None:
            self.observer.arrived(key, len(token_ids))
        return life

    def _ended(self, life: RequestLife, is_cut_short: bool) -> None:
        """The client's stream ended: its trace's outcome; the life settles (background)."""
        finish = life.stream.finish
        if finish is not None:
            life.trace.set(
                **{
                    "gen_ai.response.finish_reasons": (finish.reason,),
                    "gen_ai.usage.output_tokens": finish.usage.completion_tokens,
                    "baton.cached_tokens": finish.usage.cached_prompt_tokens,
                    "baton.migrations": life.num_migrations,
                }
            )
        self._spawn(life.settle(is_cut_short))

    def _settled(self, life: RequestLife) -> None:
        """A life settled (its ``on_settled``, once): the id is free, the quota back."""
        stream = life.stream
        self._requests.pop(stream.request_id, None)
        self.quotas.release(life.principal)
        if self.observer is not None:
            self.observer.ended(
                stream.request_id, stream.num_output_tokens, stream.num_cached_tokens
            )

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
        life = self._requests.get(key)
        if life is None or (principal is not None and principal != life.principal):
            return False
        return life.abort()  # the stream ends with ABORT

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
        requests, name = self._requests, view.name
        for event in batch.events:
            life = requests.get(event.request_id)
            if life is not None:
                life.inbox.put_event(name, event)
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
            life = self._requests.get(request_id)
            if life is not None and life.lose(view):
                moved.append(request_id)
        return moved
