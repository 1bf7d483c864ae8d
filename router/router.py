"""The disaggregated request flow (DESIGN §3): validate, route, hand off, stream, abort.

``Router.generate`` is an async generator of ``GenerateResponse`` messages; the gRPC
servicer (``server.py``) is a thin adapter over it. Errors are :class:`RouterError` with
the gRPC status code to answer.

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
from dataclasses import replace
from functools import partial

from proto.baton.v1 import inference_pb2 as pb
from router.config import RouterConfig, RouterError
from router.policy import NoHealthyWorker, RouteRequest, route
from router.recovery import Recovery, Restarter, RestartPolicy
from router.stream import RequestStream
from router.validation import InvalidRequest, ValidRequest, prompt_token_ids, validate
from router.workers import WorkerClient, WorkerView, abort_on, decline
from workers.protocol.block_hashes import hash_prompt_blocks
from workers.protocol.wire import OutputBatch, TokenEvent, WorkItem
from workers.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_SETTLE_TIMEOUT_S = 10.0  # how long an ended request waits for its worker's last event


class _Pending:
    """A request in flight: its event queue and who currently owns it."""

    def __init__(self, stream: RequestStream):
        self.stream = stream
        self.events: asyncio.Queue[tuple[str, TokenEvent | None]] = asyncio.Queue()
        self.owner: WorkerView | None = None  # the worker whose final event ends it there
        self.decode: WorkerView | None = None
        # A prefill worker's handle that no decode worker took: it must be declined.
        self.unread_handles: tuple[bytes, ...] = ()  # one per prefill rank
        self.submit: asyncio.Future | None = None  # the last submit call in flight
        self.is_aborted = False


class Router:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        prefill: Sequence[WorkerClient],
        decode: Sequence[WorkerClient],
        restarter: Restarter | None = None,
        restart_policy: RestartPolicy | None = None,
    ):
        """Without a ``restarter`` a dead worker stays out of routing for good."""
        self.config = config
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
        self._requests: dict[str, _Pending] = {}
        self._cursor = 0
        self._background: set[asyncio.Task] = set()

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

    async def stop(self) -> None:
        """Stop listening; restarts in progress are cancelled (the cluster cleans up)."""
        self.is_stopped = True
        if self.recovery is not None:
            await self.recovery.stop()
        for view in self._by_name.values():
            view.is_alive = False  # what follows (the channel closing) is no failure
            view.client.close()

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
        view.active.clear()  # their requests ended when the worker died
        view.is_alive = True
        self._listen(view)

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
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(left)

    # ---- requests --------------------------------------------------------------------
    async def generate(self, req: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request's deltas and its final message; raises RouterError."""
        if self.is_draining:
            raise RouterError("UNAVAILABLE", "the server is draining")
        request_id = req.request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise RouterError("INVALID_ARGUMENT", f"request_id: {request_id!r} is already in use")
        valid, token_ids = self._validate(req, request_id)
        if len(self._requests) >= self.config.max_queued_requests:
            raise RouterError(
                "RESOURCE_EXHAUSTED",
                f"{len(self._requests)} requests in flight (router.max_queued_requests="
                f"{self.config.max_queued_requests}); retry later",
            )
        stream = RequestStream(
            request_id,
            token_ids,
            valid.params,
            self.tokenizer,
            return_text=valid.return_text,
            return_timing=valid.return_timing,
        )
        pending = _Pending(stream)
        self._requests[request_id] = pending
        settled = False
        try:
            async for message in self._run(pending, valid, token_ids):
                yield message
            settled = True
        finally:
            if not settled:  # cancelled, deadline, or an error: stop it on the worker
                pending.is_aborted = True
            self._spawn(self._settle(pending))

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight; False if there is none with that id."""
        pending = self._requests.get(request_id)
        if pending is None or pending.stream.is_finished:
            return False
        pending.is_aborted = True
        await pending.events.put(("", None))  # wakes the stream, which ends with ABORT
        return True

    def _validate(self, req: pb.GenerateRequest, request_id: str) -> tuple[ValidRequest, list[int]]:
        cfg = self.config
        try:
            valid = validate(req, cfg.model_name, request_id)
            token_ids = prompt_token_ids(valid, self.tokenizer, cfg.vocab_size, cfg.max_model_len)
        except InvalidRequest as exc:
            raise RouterError("INVALID_ARGUMENT", str(exc)) from None
        return valid, token_ids

    async def _run(
        self, pending: _Pending, valid: ValidRequest, token_ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        stream = pending.stream
        decision = self._route(valid, token_ids)
        decode = pending.decode = self._by_name[decision.decode]
        stream.timing.decode_worker = decode.name
        item = WorkItem(stream.request_id, tuple(token_ids), valid.params, "full")
        if decision.prefill is not None:
            prefill = self._by_name[decision.prefill]
            stream.timing.prefill_worker = prefill.name
            handle_event = None
            async for message, event in self._stream_from(
                pending, prefill, replace(item, mode="prefill")
            ):
                if event is not None and event.kv_handles:
                    handle_event = event
                    break
                if message is not None:
                    yield message
            if handle_event is None:
                return  # ended on the prefill worker (first token was the last, or abort)
            # P holds the KV under a lease until a decode worker's notice or expiry; until
            # D has the handle, ending the request means declining it (see _settle).
            pending.unread_handles = handle_event.kv_handles
            first = replace(handle_event, finished=False, kv_handles=())
            message = stream.on_event(first)
            if message is not None:
                yield message
            if pending.is_aborted and not stream.is_finished:
                yield stream.abort_message()
            if stream.is_finished:
                return  # a stop string on the first token, or an abort
            item = replace(
                item,
                mode="decode",
                kv_handles=handle_event.kv_handles,
                first_token_id=handle_event.token_ids[0],
            )
        async for message, _event in self._stream_from(pending, decode, item):
            if message is not None:
                yield message

    async def _stream_from(
        self, pending: _Pending, worker: WorkerView, item: WorkItem
    ) -> AsyncIterator[tuple[pb.GenerateResponse | None, TokenEvent | None]]:
        """Submit ``item`` to ``worker`` and yield (client message, event) until the end."""
        stream = pending.stream
        if not worker.is_healthy:
            raise RouterError("UNAVAILABLE", f"worker {worker.name} is not healthy")
        pending.owner = worker
        worker.active.add(stream.request_id)
        if not stream.timing.submitted:
            stream.timing.submitted = time.monotonic()
        # Shielded: a cancel must not race its abort past the submit (a threaded actor
        # does not keep call order); _settle waits for this before aborting.
        pending.submit = asyncio.ensure_future(worker.client.submit(item))
        if item.mode == "decode":
            # Once D has the handle, D's notice (or expiry) ends the lease: never decline it
            # then, even if this coroutine is cancelled while the submit is in flight.
            def delivered(future: asyncio.Future) -> None:
                if not future.cancelled() and future.exception() is None:
                    pending.unread_handles = ()

            pending.submit.add_done_callback(delivered)
        try:
            await asyncio.shield(pending.submit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            worker.active.discard(stream.request_id)
            pending.owner = None
            raise RouterError("UNAVAILABLE", f"worker {worker.name}: {exc}") from None
        while True:
            source, event = await pending.events.get()
            if event is None:
                if source:  # the worker died
                    raise RouterError("INTERNAL", f"worker {source} failed: {worker.error}")
                if pending.is_aborted:  # Abort
                    yield stream.abort_message(), None
                    return
                continue
            if source != worker.name:
                continue  # a late event from the previous owner
            if event.finished:
                # Its end on this worker (a handle event ends the prefill worker's part).
                worker.active.discard(stream.request_id)
                if not event.kv_handles:
                    pending.owner = None
                if event.error:
                    raise RouterError("INTERNAL", f"worker {worker.name}: {event.error}")
            if event.kv_handles:
                yield None, event
                continue
            message = stream.on_event(event)
            yield message, event
            if stream.is_finished:
                return

    def _route(self, valid: ValidRequest, token_ids: list[int]):
        cfg = self.config
        disaggregation = valid.disaggregation or cfg.disaggregation
        request = RouteRequest(
            num_prompt_tokens=len(token_ids),
            block_hashes=tuple(hash_prompt_blocks(token_ids, cfg.block_size)),
            block_size=cfg.block_size,
        )
        try:
            decision = route(
                request,
                [v.state() for v in self.prefill],
                [v.state() for v in self.decode],
                policy=cfg.policy,  # type: ignore[arg-type]
                disaggregation=disaggregation,  # type: ignore[arg-type]
                auto_local_prefill_tokens=cfg.auto_local_prefill_tokens,
                saturated_queue=cfg.saturated_queue,
                cursor=self._cursor,
            )
        except NoHealthyWorker as exc:
            raise RouterError("UNAVAILABLE", str(exc)) from None
        self._cursor = decision.round_robin_cursor
        return decision

    async def _settle(self, pending: _Pending) -> None:
        """After the client's stream ended: make sure the worker side ended too."""
        request_id = pending.stream.request_id
        try:
            if pending.submit is not None:  # let a submit in flight land before its abort
                await asyncio.wait([pending.submit], timeout=_SETTLE_TIMEOUT_S)
            if pending.unread_handles:
                await decline(pending.unread_handles, pending.decode, self.decode)
            owner = pending.owner
            if owner is None or (owner.client.role == "prefill" and pending.unread_handles):
                return
            if pending.is_aborted or pending.stream.is_finished:
                await abort_on(owner, request_id)
            deadline = time.monotonic() + _SETTLE_TIMEOUT_S
            while request_id in owner.active and owner.is_alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("%s: no final event from %s", request_id, owner.name)
                    break
                try:
                    source, event = await asyncio.wait_for(pending.events.get(), left)
                except asyncio.TimeoutError:
                    continue
                if source != owner.name or event is None or not event.finished:
                    continue
                owner.active.discard(request_id)
                if event.kv_handles:  # prefill finished before the abort came
                    await decline(event.kv_handles, pending.decode, self.decode)
        finally:
            if pending.owner is not None:
                pending.owner.active.discard(request_id)
            self._requests.pop(request_id, None)

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
        view.update(batch.report)
        for event in batch.events:
            pending = self._requests.get(event.request_id)
            if pending is not None:
                pending.events.put_nowait((view.name, event))
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
        for request_id in list(view.active):
            pending = self._requests.get(request_id)
            if pending is not None and pending.owner is view:
                pending.events.put_nowait((view.name, None))
        view.active.clear()
        if self.recovery is not None:
            self.recovery.worker_lost(view.name)
