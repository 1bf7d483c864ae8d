"""One worker's engine loop on its own thread, driven by the router's work items.

The service is what a prefill or decode worker runs (the Ray actor in ``ray_worker.py``
is a thin adapter around it; tests use it in-process). The engine and the block manager
are not thread-safe, so *only the loop thread touches them*: ``submit``, ``abort`` and
``decline`` queue commands (``workers/serving/commands.py``); the KV connector's
``on_release`` queues one too; transfer futures wake the loop. The loop pushes its output
batches into a sink from its own thread (``attach``: the worker's event channel to the
router, ``workers/serving/channel.py``); until a sink is attached it keeps them.

Each request's hand-off state, and who frees which block when, is the engine's
``KVHandoff`` (``workers/engine/handoff.py``); the loop drives its transport side, keyed
by request id: the offers' and receives' futures, the handles to receive from or decline.

- Prefill: a request whose first token does not end it is HELD; the loop offers its
  blocks to the connector (a lease, on every rank; OFFERED) and publishes the handles once
  every rank has answered (LEASED). The blocks are freed when the lease ends (decode's
  notice, or expiry), never on abort, or at once if the offer fails.
- Decode: a request admitted with handles gets fresh blocks; the loop starts the receive
  into exactly those (RECEIVING). An abort while receiving asks the connector to stop,
  and the blocks are freed only when the receive's future completes (nothing writes them
  then). A decode request that ends before its receive starts declines the handles, so
  the prefill worker frees its blocks at once instead of at lease expiry.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvtransfer import KVConnector, KVHandle
from kvtransfer.messages import decode_as as decode_kv
from workers.engine.handoff import HandoffState
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StreamDelta
from workers.parallel.replica_kv import ReplicaKV
from workers.protocol.wire import OutputBatch, TokenEvent, WorkItem
from workers.serving.channel import HEARTBEAT_S
from workers.serving.commands import Abort, Attach, Command, Decline, LeaseEnded, Sink, Submit
from workers.serving.events import failed_event, token_event
from workers.serving.metrics import WorkerMetrics
from workers.serving.worker_report import ReportBuilder

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # nothing to compute: how long the loop sleeps unless woken


@dataclass
class _Receive:
    """Decode: a receive in flight (its request RECEIVING or ABORTING in the hand-off)."""

    future: Future  # completes once nothing writes the request's blocks any more
    is_cancelled: bool = False  # the connector was asked to stop it


class EngineService:
    def __init__(
        self,
        engine: LLMEngine,
        name: str,
        role: str,
        connector_factory: Callable[[LLMEngine, Callable[[str, str], None]], KVConnector]
        | None = None,
        on_failure: str = "recompute",
        replica: ReplicaKV | None = None,
        metrics: WorkerMetrics | None = None,
    ):
        """``replica``: rank 0's end of a tensor-parallel replica (its engine's
        ``before_forward`` must be the same object's); None for a one-rank worker.
        ``metrics``: this worker's Prometheus series (None: in-memory ones nobody serves)."""
        self.engine = engine
        self.name = name
        self.role = role
        self.on_failure = on_failure
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._events: list[TokenEvent] = []  # loop thread only: kept until a sink attaches
        self._errors: dict[str, str] = {}  # loop thread only: why a request failed
        self._transfer: dict[str, tuple[float, int]] = {}  # loop thread only
        # The hand-off's transport side, loop thread only, keyed by the hand-off's ids:
        # decode: msgpack KVHandle per prefill rank (checked on admission), until the
        # receive starts (RECEIVING) or the handles are declined (DECLINING);
        self._handles: dict[str, tuple[bytes, ...]] = {}
        self._receives: dict[str, _Receive] = {}  # decode: RECEIVING / ABORTING
        # prefill: OFFERED, the held delta and the offer's future (every rank's handle).
        self._offers: dict[str, tuple[StreamDelta, Future]] = {}
        self.handoff = engine.handoff
        self._reports = ReportBuilder(engine, name, role)  # loop thread only
        self._stopping = False
        self._failed: str | None = None
        self._sink: Sink | None = None  # loop thread only
        self._sent_at = 0.0
        self.metrics = metrics or WorkerMetrics(role, "", name)
        engine.scheduler.on_first_scheduled = self.metrics.first_scheduled
        # Every KV operation goes through self.kv: it spans all ranks of the replica.
        self.kv = replica if replica is not None else ReplicaKV()
        self.connector = (
            connector_factory(engine, self.kv.local_released)
            if connector_factory is not None
            else None
        )
        self.kv.bind(self.connector, self._on_release, self._wake.set)
        self.kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------
    def submit(self, item: WorkItem) -> None:
        self._command(Submit(item))

    def abort(self, request_id: str) -> None:
        self._command(Abort(request_id))

    def decline(self, handles: Sequence[bytes]) -> None:
        """Decode side, for a request aborted before it reached this worker: free P's blocks."""
        self._command(Decline(tuple(handles)))

    def attach(self, sink: Sink) -> None:
        """From now on the loop calls ``sink`` on its own thread with every batch of events,
        and with its report at least every ``HEARTBEAT_S``; what came before goes first.

        The report carries the cached block hashes only when they changed since the sink's
        last batch. A sink that raises is dropped (the router sees its channel close).
        """
        self._command(Attach(sink))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything, release every lease, stop the loop."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self.connector is not None:
            self.connector.close()

    def _command(self, command: Command) -> None:
        if self._failed is not None:
            raise RuntimeError(f"worker {self.name} failed: {self._failed}")
        self._commands.put(command)
        self._wake.set()

    def _on_release(self, request_id: str, reason: str) -> None:
        """The request's lease ended on every rank; the loop frees the held blocks."""
        if reason == "expired":
            self.metrics.lease_expired()
        self._command(LeaseEnded(request_id, reason))

    # ---- the loop (its own thread) -----------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._drain_commands()
                self.kv.poll()
                self._finish_receives()
                did_work = False
                if self.engine.has_unfinished_requests():
                    deltas = self.engine.step()
                    self._decline_ended()
                    started = self._start_receives()
                    self._publish(self._events_of(deltas))
                    # Only receiving, or waiting for blocks: sleep until something wakes us.
                    did_work = bool(deltas or started or self.engine.scheduler.running)
                self._publish(self._offered())  # every rank has answered (this step's too)
                self._reports.refresh_hashes()
                if self._sink is not None and time.monotonic() - self._sent_at >= HEARTBEAT_S:
                    self._send(())
                if not did_work:
                    self._wake.wait(min(_IDLE_WAIT_S, self.kv.wait_hint() or _IDLE_WAIT_S))
            self._shutdown_requests()
            self.kv.close()
        except Exception as exc:  # a bug or a device failure: fail loudly, not silently
            logger.exception("engine loop of %s failed", self.name)
            self._fail(f"{type(exc).__name__}: {exc}")

    def _fail(self, error: str) -> None:
        """The loop is dead: every request it had fails now (the router answers INTERNAL)."""
        self._failed = error
        self.kv.abandon()  # the other ranks stop waiting for commands
        rids = set(self.engine.scheduler.requests) | set(self._offers)
        rids |= set(self.handoff.ids(HandoffState.DECLINING))  # their finals are not out
        events = [failed_event(rid, 0, f"worker {self.name} failed: {error}") for rid in rids]
        if self._sink is not None:
            self._send(events)  # even with no events: the report says the loop is dead
        else:
            self._events.extend(events)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._run(command)
            except Exception:  # one bad command must not take the worker down
                logger.exception("%s: command %s failed", self.name, type(command).__name__)

    def _run(self, command: Command) -> None:
        match command:
            case Submit(item):
                self._admit(item)
            case Abort(request_id):
                self._abort(request_id)
            case LeaseEnded(request_id):
                self.handoff.lease_ended(request_id)  # frees the held blocks
            case Decline(handles):
                self._decline(handles)
            case Attach(sink):
                self._sink = sink
                self._reports.resend_hashes()  # a new receiver knows none yet
                events, self._events = self._events, []
                self._send(events)
            case _:
                raise TypeError(f"unknown command {command!r}")

    def _admit(self, item: WorkItem) -> None:
        rid = item.request_id
        if rid in self.engine.scheduler.requests or rid in self._handles:
            # Touch nothing: the state under this id belongs to the request that has it
            # (its handles still to decline, too).
            self._publish([failed_event(rid, 0, f"request_id {rid!r} is already in use")])
            return
        try:
            if item.mode == "decode":
                for handle in item.kv_handles:
                    decode_kv(handle, KVHandle)  # refuse a malformed one before admission
                self._handles[rid] = tuple(item.kv_handles)
                self.engine.add_request(
                    list(item.prompt_token_ids),
                    item.params,
                    rid,
                    remote_first_token=item.first_token_id,
                )
            else:
                self.engine.add_request(
                    list(item.prompt_token_ids),
                    item.params,
                    rid,
                    prefill_only=item.mode == "prefill",
                )
        except Exception as exc:
            # The router validated already; this is a worker-side refusal (an id still
            # held, a bad handle): the request fails, the worker keeps serving.
            handles = self._handles.pop(rid, None)
            if handles is not None:
                self._safe_decline(handles)
            self._publish([failed_event(rid, len(item.prompt_token_ids), f"{exc}")])

    def _abort(self, rid: str) -> None:
        if self.handoff.is_held(rid):
            # Under a lease (or about to be: a HELD delta drained into the next step's):
            # only the lease's end (a decode worker's notice, or expiry) frees these
            # blocks; a decode worker may be reading them right now.
            return
        receive = self._receives.get(rid)
        if receive is not None and not receive.future.done():
            receive.is_cancelled = True
            if self.connector is not None:
                try:
                    self.kv.abort(rid)
                except Exception:  # the receive still ends by its deadline
                    logger.warning("%s: cannot abort the receive of %s", self.name, rid)
        self.engine.abort_request(rid)

    def _decline(self, handles: tuple[bytes, ...]) -> None:
        try:
            for handle in handles:
                decode_kv(handle, KVHandle)
        except ValueError:
            logger.warning("ignoring a malformed handle to decline")
            return
        self._safe_decline(handles)

    def _safe_decline(self, handles: tuple[bytes, ...]) -> None:
        if self.connector is None:
            return
        try:
            self.kv.decline(handles)
        except Exception:  # the owner will free at lease expiry instead
            logger.warning("could not decline KV handles", exc_info=True)

    def _decline_ended(self) -> None:
        """Decode: requests that ended before their receive started (aborted while
        queued): decline their handles, so that P frees its blocks now."""
        for rid in self.handoff.take_declines():
            handles = self._handles.pop(rid, None)
            if handles is not None:
                self._safe_decline(handles)

    def _start_receives(self) -> int:
        """Decode: start the receive of every request the engine gave blocks."""
        started = self.engine.take_kv_receives()
        for rid, block_ids in started:
            handles = self._handles.pop(rid)
            if self.connector is None:
                self._errors[rid] = "no KV connector on this worker"
                self.engine.abort_request(rid)
                self.engine.kv_received(rid, ok=False)
                continue
            try:
                future = self.kv.receive(handles, block_ids)
            except Exception as exc:
                future = Future()
                future.set_exception(exc)
            self._receives[rid] = _Receive(future)
            future.add_done_callback(lambda _f: self._wake.set())
        return len(started)

    def _finish_receives(self) -> None:
        """Decode: tell the engine of every receive that ended (its blocks are free to use)."""
        for rid, receive in list(self._receives.items()):
            future = receive.future
            if not future.done():
                continue
            del self._receives[rid]
            exc = future.exception()
            if exc is None:
                result = future.result()
                self._transfer[rid] = (result.seconds, result.num_bytes)
                self.metrics.transferred(result.seconds, result.num_bytes)
                self.engine.kv_received(rid, ok=True)
            elif receive.is_cancelled:
                self.engine.kv_received(rid, ok=False)  # the engine finishes it as ABORT
            else:
                self._transfer_failed(rid, exc)

    def _transfer_failed(self, rid: str, exc: BaseException) -> None:
        self.metrics.transfer_failed("receive")
        if self.on_failure == "recompute":
            logger.warning("KV transfer of %s failed (%s); recomputing", rid, exc)
        else:
            self._errors[rid] = f"KV transfer failed: {exc}"
            self.engine.abort_request(rid)
        self.engine.kv_received(rid, ok=False)

    def _events_of(self, deltas: Sequence[StreamDelta]) -> list[TokenEvent]:
        """The step's events; a finished prefill's waits for its offer (``_offered``)."""
        events = []
        for delta in deltas:
            if delta.held_block_ids is not None:
                self._offer(delta)
            else:
                events.append(self._event(delta))
        return events

    def _event(self, delta: StreamDelta, kv_handles: tuple[bytes, ...] = ()) -> TokenEvent:
        rid = delta.request_id
        transfer = self._transfer.pop(rid, (0.0, 0))
        error = self._errors.pop(rid, "") if delta.finished else ""
        return token_event(delta, kv_handles=kv_handles, transfer=transfer, error=error)

    def _offer(self, delta: StreamDelta) -> None:
        """Prefill: put the held blocks under a lease on every rank (``_offered`` sends
        the event with the handles, one per rank, once every rank has answered)."""
        block_ids = self.handoff.offer(delta.request_id)  # HELD -> OFFERED
        future = self.kv.offer(
            delta.request_id,
            block_ids,
            num_tokens=delta.num_prompt_tokens,
            first_token_id=delta.token_ids[0],
        )
        self._offers[delta.request_id] = (delta, future)

    def _offered(self) -> list[TokenEvent]:
        """Events of the offers that completed: the handles, or a failure (blocks freed)."""
        events = []
        for rid, (delta, future) in list(self._offers.items()):
            if not future.done():
                continue
            del self._offers[rid]
            exc = future.exception()
            if exc is None:
                self.handoff.offered(rid)  # -> LEASED: only the lease's end frees the blocks
                events.append(self._event(delta, future.result()))
                continue
            self.handoff.offer_failed(rid)  # no handle went out: the blocks are freed now
            self.metrics.transfer_failed("offer")
            error = f"cannot offer KV: {exc}"
            events.append(failed_event(rid, delta.num_prompt_tokens, error))
        return events

    def _publish(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        if self._sink is not None:
            self._send(events)
        else:
            self._events.extend(events)

    def _send(self, events: Sequence[TokenEvent]) -> None:
        """Push ``events`` with a fresh report (built only now: nobody reads one between)."""
        failed = self._failed
        report = self._reports.next(healthy=not (self._stopping or failed), error=failed or "")
        self.metrics.report(report)
        try:
            self._sink(OutputBatch(tuple(events), report))  # type: ignore[misc]
        except Exception:
            logger.exception("%s: the event sink failed; dropping it", self.name)
            self._sink = None
            return
        self._sent_at = time.monotonic()

    def _shutdown_requests(self) -> None:
        """Stopping: abort what runs, wait for receives to settle, free held blocks."""
        for rid in list(self.engine.scheduler.requests):
            self._abort(rid)
        deadline = time.monotonic() + 5.0
        while self._offers or self._receives:
            if time.monotonic() > deadline:
                break
            self.kv.poll()  # the other ranks' parts
            self._finish_receives()
            self._publish(self._offered())
            time.sleep(0.01)
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            self._finish_receives()
            deltas = self.engine.step()
            self._decline_ended()
            self._publish(self._events_of(deltas))
