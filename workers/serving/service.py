"""One worker's engine loop on its own thread, driven by the router's work items.

The service is what a prefill or decode worker runs (the Ray actor in ``ray_worker.py``
is a thin adapter around it; tests use it in-process). The engine and the block manager
are not thread-safe, so *only the loop thread touches them*: ``submit``, ``abort`` and
``decline`` queue commands (``workers/serving/commands.py``); the KV connector's
``on_release`` queues one too; transfer futures wake the loop. The loop pushes its output
batches into a sink from its own thread (``attach``: the worker's event channel to the
router, ``workers/serving/channel.py``); until a sink is attached it keeps them.

Each request's hand-off state, and who frees which block when, is the engine's
``KVHandoff`` (``workers/engine/handoff.py``); the loop drives its transport side
(``workers/serving/handoff_transport.py``: offers, receives and declines in flight).
Held blocks are freed when their lease ends (``LeaseEnded``: decode's notice, or
expiry), never on abort.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvtransfer import KVConnector, KVHandle
from kvtransfer.messages import decode_as as decode_kv
from workers.engine.handoff import HandoffState
from workers.engine.llm_engine import LLMEngine
from workers.parallel.dp_group import DpEngine
from workers.parallel.replica_kv import ReplicaKV
from workers.protocol.wire import OutputBatch, TokenEvent, WorkItem
from workers.serving.channel import HEARTBEAT_S
from workers.serving.commands import Abort, Attach, Command, Decline, LeaseEnded, Sink, Submit
from workers.serving.events import failed_event
from workers.serving.handoff_transport import HandoffTransport
from workers.serving.layerwise_stats import LayerwiseStats
from workers.serving.metrics import WorkerMetrics
from workers.serving.sinks import Sinks
from workers.serving.stream_transport import StreamTransport
from workers.serving.tracing import WorkerTraces
from workers.serving.worker_report import ReportBuilder

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # nothing to compute: how long the loop sleeps unless woken
# A data-parallel group with nothing to compute: its ranks meet this often (a peer that
# gets a request waits at most this long for the others to step with it).
_DP_IDLE_WAIT_S = 0.005


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
        dp: DpEngine | None = None,
    ):
        """``replica``: rank 0's end of a tensor-parallel replica (its engine's
        ``before_forward`` must be the same object's); None for a one-rank worker.
        ``metrics``: this worker's Prometheus series (None: in-memory ones nobody serves).
        ``dp``: this worker is one rank of a data-parallel group (``engine`` is
        ``dp.engine``): the loop steps through it every time, in lockstep with its peers,
        whether or not it has work (workers/parallel/dp_group.py)."""
        self.engine = engine
        self.dp = dp
        self.name = name
        self.role = role
        self.on_failure = on_failure
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._events: list[TokenEvent] = []  # loop thread only: kept until a sink attaches
        self._reports = ReportBuilder(engine, name, role)  # loop thread only
        self._stopping = False
        self._failed: str | None = None
        self._sinks = Sinks()  # loop thread only: one per router process
        self._sent_at = 0.0
        self.metrics = metrics or WorkerMetrics(role, "", name)
        self.traces = WorkerTraces(name, role)  # loop thread only
        engine.scheduler.on_first_scheduled = self._first_scheduled
        # Every KV operation goes through self.kv: it spans all ranks of the replica.
        self.kv = replica if replica is not None else ReplicaKV()
        self.connector = (
            connector_factory(engine, self.kv.local_released)
            if connector_factory is not None
            else None
        )
        self.kv.bind(self.connector, self._on_release, self._wake.set)
        self.kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
        self.transport = HandoffTransport(  # loop thread only
            engine,
            self.kv,
            self.connector,
            self.metrics,
            on_failure,
            self._wake.set,
            name,
            self.traces,
        )
        self.stream = self.transport.stream = StreamTransport(  # loop thread only
            engine, self.connector, self._layerwise_stats(), self._wake.set, self.metrics, self.kv
        )
        self._leases: dict[str, tuple[float, int]] = {}  # prefill: link numbers
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------
    def submit(self, item: WorkItem, router: int = 0) -> None:
        """Queue ``item``; its events go to router process ``router``'s sink (0: the first)."""
        self._command(Submit(item, router))

    def abort(self, request_id: str) -> None:
        self._command(Abort(request_id))

    def decline(self, handles: Sequence[bytes]) -> None:
        """Decode side, for a request aborted before it reached this worker: free P's blocks."""
        self._command(Decline(tuple(handles)))

    def attach(self, sink: Sink, router: int = 0) -> None:
        """From now on the loop calls ``sink`` on its own thread with the events of the
        requests router process ``router`` submitted, and with its report at least every
        ``HEARTBEAT_S`` (every sink gets every report: each router sees the whole load and
        cache); a new sink for ``router`` replaces its old one. Router 0's sink also gets
        what came before it attached.

        A sink that raises is dropped (the router sees its channel close), and the
        requests of its router are aborted here: nobody would read their tokens.
        """
        self._command(Attach(sink, router))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything, release every lease, stop the loop (a data-parallel group's
        every rank's loop, together, after one more step)."""
        if self.dp is not None and self._thread.is_alive():
            self.dp.stopping = True  # the group stops together (workers/parallel/dp_group.py)
        else:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self.connector is not None:
            self.connector.close()
        tiers = self.engine.kv_tiers
        if tiers is not None and not self._thread.is_alive():
            # Nothing writes the pool now: the blocks it holds and those the disk writer
            # had not reached go down to disk (within kv_tiers' FLUSH_S), the host tier
            # is freed, the disk tier's directory unlocked; its files stay for the next
            # start. (A loop that did not stop may still write: no flush then.)
            done = tiers.close()
            if done.written or done.dropped or done.failed:
                logger.info(
                    "%s: wrote %d KV blocks down to disk at stop in %.2f s "
                    "(%d dropped: out of time or room, %d failed)",
                    self.name,
                    done.written,
                    done.seconds,
                    done.dropped,
                    done.failed,
                )

    def _layerwise_stats(self) -> LayerwiseStats | None:
        """Prefill with kv_transfer.layerwise auto or on (any TP/PP on either side: every
        rank streams its part, ``ReplicaKV``): the numbers the layer-wise hand-off is
        chosen from, rank 0's (workers/serving/layerwise_stats.py)."""
        engine = self.engine
        config = getattr(self.connector, "config", None)
        mode = getattr(config, "layerwise", "off")
        if self.role != "prefill" or self.connector is None or mode not in ("auto", "on"):
            return None
        cache = engine.kv_cache
        stats = LayerwiseStats(
            num_layers=cache.shape[1],
            block_size=engine.block_manager.block_size,
            block_layer_bytes=cache[0, 0].numel() * cache.element_size(),
            chunk_tokens=engine.config.max_num_batched_tokens,
            max_prompt_tokens=engine.max_model_len - 1,
            forced_min_tokens=config.layerwise_min_tokens if mode == "on" else 0,
        )
        engine.step_times.listeners.append(stats.observe_step)
        self._reports.layerwise_min_tokens = stats.min_tokens
        return stats

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
                self.stream.poll()
                self.transport.finish_receives()
                did_work = False
                if self.dp is not None or self.engine.has_unfinished_requests():
                    deltas = self.dp.step() if self.dp is not None else self.engine.step()
                    self.transport.decline_ended()
                    started = self.transport.start_receives()
                    self._publish(self.transport.events_of(deltas))
                    # Only receiving, or waiting for blocks: sleep until something wakes us.
                    did_work = bool(deltas or started or self.engine.scheduler.running)
                    # A group's peer is computing: step again at once (its collectives
                    # need this rank's empty forward).
                    did_work = did_work or (self.dp is not None and not self.dp.is_idle)
                # Every rank has answered (this step's offers too).
                self._publish(self._leased(self.transport.offered()))
                self._publish(self.stream.take_events())  # layer-wise reservations
                self._reports.refresh()
                if self._sinks and time.monotonic() - self._sent_at >= HEARTBEAT_S:
                    self._send(())
                if self.dp is not None and self.dp.is_group_stopping:
                    self._stopping = True  # a rank of the group stops: all do, now
                    break
                if not did_work:
                    idle = _IDLE_WAIT_S if self.dp is None else _DP_IDLE_WAIT_S
                    self._wake.wait(min(idle, self.kv.wait_hint() or idle))
            self._shutdown_requests()
            self.kv.close()
        except Exception as exc:  # a bug or a device failure: fail loudly, not silently
            logger.exception("engine loop of %s failed", self.name)
            self._fail(f"{type(exc).__name__}: {exc}")

    def _fail(self, error: str) -> None:
        """The loop is dead: every request it had fails now (the router answers INTERNAL)."""
        self._failed = error
        self.kv.abandon()  # the other ranks stop waiting for commands
        rids = set(self.engine.scheduler.requests) | set(self.transport.offers)
        rids |= set(self.engine.handoff.ids(HandoffState.DECLINING))  # finals not out yet
        why = f"worker {self.name} failed: {error}"
        events = [failed_event(rid, 0, why, is_retryable=True) for rid in rids]
        if self._sinks:
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
            case Submit(item, router):
                self._sinks.own(item.request_id, router)
                self._admit(item)
            case Abort(request_id):
                self._abort(request_id)
            case LeaseEnded(request_id, reason):
                self.engine.handoff.lease_ended(request_id)  # frees the held blocks
                self._lease_ended(request_id, reason)
            case Decline(handles):
                self._decline(handles)
            case Attach(sink, router):
                for rid in self._sinks.attach(router, sink):
                    self._abort(rid)
                self._reports.resend()  # a new receiver knows none yet (a snapshot to all)
                events = []
                if router == 0:
                    events, self._events = self._events, []
                self._send(events)
            case _:
                raise TypeError(f"unknown command {command!r}")

    def _first_scheduled(self, req) -> None:
        self.metrics.first_scheduled(req)
        self.traces.first_scheduled(req)

    def _leased(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """Prefill: when each lease started (a whole-request transfer's link numbers)."""
        if self.stream.stats is not None:
            per_block = self.stream.block_layer_bytes * self.engine.kv_cache.shape[1]
            for event in events:
                if event.kv_handles:
                    blocks = -(-event.num_prompt_tokens // self.engine.block_manager.block_size)
                    self._leases[event.request_id] = (time.perf_counter(), blocks * per_block)
        return events

    def _lease_ended(self, request_id: str, reason: str) -> None:
        started = self._leases.pop(request_id, None)
        if started is not None and reason == "done" and self.stream.stats is not None:
            self.stream.stats.observe_link(started[1], time.perf_counter() - started[0])

    def _admit(self, item: WorkItem) -> None:
        rid = item.request_id
        if item.kv_stream_from and item.first_token_id is not None:
            # Layer-wise: the first token of a request reserved here (stream_transport.py).
            try:
                if not self.stream.first_token(item):
                    why = f"request {rid!r} holds no KV reservation here"
                    self._publish([failed_event(rid, 0, why, is_retryable=True)])
            except Exception as exc:  # (a token that ends it: its prefill worker ends it)
                self.transport.fail(rid, f"first token refused: {exc}")
                self._abort(rid)  # its final event, once nothing writes its blocks
            return
        if rid in self.engine.scheduler.requests or rid in self.transport.handles:
            # Touch nothing: the state under this id belongs to the request that has it
            # (its handles still to decline, too). A layer-wise reservation the router
            # gave up (a migration) winds down here: another try may go elsewhere.
            why = f"request_id {rid!r} is already in use"
            retry = rid in self.stream.incoming
            self._publish([failed_event(rid, 0, why, is_retryable=retry)])
            return
        self.traces.admitted(item)
        try:
            if item.kv_stream_from:  # layer-wise: admitted now, reserved once it has blocks
                self.stream.expect(item)
            elif item.kv_reservations:  # layer-wise: the KV streams into them
                self.stream.open(item)
            elif item.mode == "decode":
                for handle in item.kv_handles:
                    decode_kv(handle, KVHandle)  # refuse a malformed one before admission
                self.transport.expect(rid, tuple(item.kv_handles))
                self.engine.add_request(
                    list(item.prompt_token_ids),
                    item.params,
                    rid,
                    remote_first_token=item.first_token_id,
                )
            else:
                # A peer's lease on the prompt's first blocks (G4): pulled, not recomputed.
                num_peer = self.transport.expect_peer(rid, item)
                self.engine.add_request(
                    list(item.prompt_token_ids),
                    item.params,
                    rid,
                    prefill_only=item.mode == "prefill",
                    prior_output_token_ids=item.output_token_ids,
                    peer_prefix_tokens=num_peer,
                )
        except Exception as exc:
            # The router validated already; this is a worker-side refusal (an id still
            # held, a bad handle): the request fails, the worker keeps serving.
            self.transport.refused(rid)
            failed = failed_event(rid, len(item.prompt_token_ids), f"{exc}")
            self._publish([self.transport.with_spans(failed)])

    def _abort(self, rid: str) -> None:
        if self.engine.handoff.is_held(rid):
            # Under a lease (or about to be: a HELD delta drained into the next step's):
            # only the lease's end (a decode worker's notice, or expiry) frees these
            # blocks; a decode worker may be reading them right now.
            return
        self.transport.cancel(rid)  # a receive in flight: its end frees the blocks
        self.stream.abort(rid)  # a stream out: its end frees the blocks
        self.engine.abort_request(rid)

    def _decline(self, handles: tuple[bytes, ...]) -> None:
        try:
            for handle in handles:
                decode_kv(handle, KVHandle)
        except ValueError:
            logger.warning("ignoring a malformed handle to decline")
            return
        self.transport.decline(handles)

    def _publish(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        if self._sinks:
            self._send(events)
        else:
            self._events.extend(events)

    def _send(self, events: Sequence[TokenEvent]) -> None:
        """Push ``events`` with a fresh report (built only now: nobody reads one between)."""
        failed = self._failed
        report = self._reports.next(healthy=not (self._stopping or failed), error=failed or "")
        self.metrics.report(report)
        for router, sink, mine in self._sinks.split(events, report, time.monotonic()):
            try:
                sink(OutputBatch(mine, report))
            except Exception:
                logger.exception(
                    "%s: router %d's event sink failed; dropping it", self.name, router
                )
                for rid in self._sinks.drop(router):  # its router is gone: stop its work
                    self._abort(rid)
        self._sent_at = time.monotonic()

    def _shutdown_requests(self) -> None:
        """Stopping: abort what runs, wait for receives to settle, free held blocks."""
        for rid in list(self.engine.scheduler.requests):
            self._abort(rid)
        deadline = time.monotonic() + 5.0
        while self.transport.is_pending or self.stream.is_pending:
            if time.monotonic() > deadline:
                break
            self.kv.poll()  # the other ranks' parts
            self.stream.poll()
            self.transport.finish_receives()
            self._publish(self.transport.offered())
            time.sleep(0.01)
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            self.transport.finish_receives()
            deltas = self.engine.step()
            self.transport.decline_ended()
            self._publish(self.transport.events_of(deltas))
