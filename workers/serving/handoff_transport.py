"""The transport side of one worker's KV hand-offs: handles, offers and receives in flight.

Each request's hand-off state, and so who frees which block when, is the engine's
``KVHandoff`` (``workers/engine/handoff.py``); this class moves the KV for it over the
replica's connectors (``ReplicaKV``) and tells it what happened, keyed by request id.
It runs on the worker's engine loop thread only (``workers/serving/service.py``).

- Prefill: a HELD request's blocks are offered on every rank (OFFERED); once every rank
  has answered, its event goes out with the handles (LEASED), or it fails and the blocks
  are freed at once (no handle went out). The lease's end frees them otherwise.
- Decode: the handles of an admitted request are kept until the engine gives it blocks;
  then the receive starts into exactly those (RECEIVING), and the engine hears when the
  receive's future completes (nothing writes the blocks then). An abort meanwhile asks
  the connector to stop. A request that ends before its receive started has its handles
  declined, so that the prefill worker frees its blocks now instead of at lease expiry.
  Only the blocks after the worker's own prefix-cache hit are received (a partial
  receive: ``slice_handles``).
- Peer pull (G4, any role): a full or prefill request may come with another worker's
  handles on its prompt's first blocks (``expect_peer``); they are received the same way,
  and the rest of the prompt is computed here. A failed peer receive always recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from msgspec.structs import replace

from kvtransfer import KVConnector, KVHandle
from kvtransfer.messages import decode_as as decode_kv
from kvtransfer.messages import encode as encode_kv
from workers.engine.handoff import KVReceive
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StreamDelta
from workers.parallel.replica_kv import ReplicaKV
from workers.protocol.wire import TokenEvent, WorkItem
from workers.serving.events import failed_event, token_event
from workers.serving.metrics import WorkerMetrics
from workers.serving.stream_transport import StreamTransport
from workers.serving.tracing import WorkerTraces

logger = logging.getLogger(__name__)


@dataclass
class _Receive:
    """Decode: a receive in flight (its request RECEIVING or ABORTING in the hand-off)."""

    future: Future  # completes once nothing writes the request's blocks any more
    is_cancelled: bool = False  # the connector was asked to stop it
    first_block: int = 0  # prompt blocks this worker held already (not received)
    num_blocks: int = 1  # prompt blocks received
    source: str = "prefill"  # whose lease: a prefill worker's hand-off, or a peer's (G4)


def slice_handles(handles: Sequence[bytes], first_block: int, num_blocks: int) -> tuple[bytes, ...]:
    """The owner's handles (msgpack), each reading ``num_blocks`` of its lease's blocks
    from block ``first_block`` on: the blocks before are this worker's own prefix-cache
    hits; a peer pull's lease may also hold blocks after the prefix it gives."""
    out = []
    for data in handles:
        handle = decode_kv(data, KVHandle)
        if first_block == 0 and len(handle.block_ids) == num_blocks:
            out.append(data)
        else:
            out.append(encode_kv(handle.from_block(first_block, first_block + num_blocks)))
    return tuple(out)


def peer_prefix_tokens(handles: Sequence[bytes], num_prompt_tokens: int, block_size: int) -> int:
    """Peer pull: the prompt tokens whose KV the peer's lease gives, whole blocks that
    leave at least one prompt token to compute here (0: none worth reading)."""
    num_blocks = min(
        min(decode_kv(h, KVHandle).num_tokens // block_size for h in handles),
        min(len(decode_kv(h, KVHandle).block_ids) for h in handles),
        (num_prompt_tokens - 1) // block_size,
    )
    return max(num_blocks, 0) * block_size


class HandoffTransport:
    def __init__(
        self,
        engine: LLMEngine,
        kv: ReplicaKV,
        connector: KVConnector | None,
        metrics: WorkerMetrics,
        on_failure: str,
        wake: Callable[[], None],
        name: str,
        traces: WorkerTraces | None = None,
    ):
        self.engine = engine
        self.handoff = engine.handoff
        self.kv = kv  # every KV operation spans all ranks of the replica
        self.connector = connector
        self.metrics = metrics
        self.on_failure = on_failure
        self._wake = wake
        self.name = name
        # The traced requests' spans, attached to their last event here (tracing.py).
        self.traces = traces if traces is not None else WorkerTraces(name, "")
        # Decode: msgpack KVHandle per prefill rank (checked on admission), until the
        # receive starts (RECEIVING) or the handles are declined (DECLINING).
        self.handles: dict[str, tuple[bytes, ...]] = {}
        self.receives: dict[str, _Receive] = {}  # decode: RECEIVING / ABORTING
        # Prefill: OFFERED, the held delta and the offer's future (every rank's handle).
        self.offers: dict[str, tuple[StreamDelta, Future]] = {}
        self._errors: dict[str, str] = {}  # why a request failed, for its final event
        self._retryable: set[str] = set()  # of those, failed by a transfer: may migrate
        self._transfer: dict[str, tuple[float, int]] = {}  # (seconds, bytes) received
        # Decode: bytes of prompt blocks not received because this worker held them
        # (its prefix cache), over the receives that succeeded.
        self.bytes_not_received = 0
        self._peer_ids: set[str] = set()  # of self.handles: a peer's (G4), not P's
        self.stream: StreamTransport | None = None  # layer-wise (stream_transport.py)

    @property
    def is_pending(self) -> bool:
        """An offer or a receive is in flight (stopping waits for them)."""
        return bool(self.offers or self.receives)

    # ---- decode ------------------------------------------------------------------------
    def expect(self, request_id: str, handles: tuple[bytes, ...]) -> None:
        """A decode request is being admitted with P's (validated) handles."""
        self.handles[request_id] = handles

    def expect_peer(self, request_id: str, item: WorkItem) -> int:
        """Peer pull (G4): a full or prefill request that came with a peer's handles on its
        prompt's first blocks. Returns the prompt tokens to pull (0: none; the handles,
        if any, are declined at once)."""
        if not item.kv_handles:
            return 0
        block_size = self.engine.block_manager.block_size
        num_tokens = peer_prefix_tokens(item.kv_handles, len(item.prompt_token_ids), block_size)
        if num_tokens == 0 or self.connector is None:
            self.decline(tuple(item.kv_handles))
            self.metrics.peer_pull("unused")
            return 0
        self.handles[request_id] = tuple(item.kv_handles)
        self._peer_ids.add(request_id)
        return num_tokens

    def refused(self, request_id: str) -> None:
        """Its admission failed: nothing will read P's blocks, decline the handles."""
        handles = self.handles.pop(request_id, None)
        if handles is not None:
            self.decline(handles)
        if self.stream is not None:
            self.stream.forget(request_id)
        if request_id in self._peer_ids:
            self._peer_ids.discard(request_id)
            self.metrics.peer_pull("unused")

    def cancel(self, request_id: str) -> None:
        """An abort: ask the connector to stop the request's receive, if one runs."""
        receive = self.receives.get(request_id)
        if receive is None or receive.future.done():
            return
        receive.is_cancelled = True
        if self.connector is not None:
            try:
                self.kv.abort(request_id)
            except Exception:  # the receive still ends by its deadline
                logger.warning("%s: cannot abort the receive of %s", self.name, request_id)

    def decline(self, handles: tuple[bytes, ...]) -> None:
        """Nothing will read these handles: their owners free the blocks now."""
        if self.connector is None:
            return
        try:
            self.kv.decline(handles)
        except Exception:  # the owner will free at lease expiry instead
            logger.warning("could not decline KV handles", exc_info=True)

    def decline_ended(self) -> None:
        """Requests that ended before their receive started (aborted while queued):
        decline their handles, so that P frees its blocks now."""
        for request_id in self.handoff.take_declines():
            self.refused(request_id)

    def start_receives(self) -> int:
        """Start the receive of every request the engine gave blocks; how many."""
        started = self.handoff.take_receives()
        for receive in started:
            request_id = receive.request_id
            if self.stream is not None and request_id in self.stream.incoming:
                self._reserve(receive)
                continue
            handles = self.handles.pop(request_id)
            source = "peer" if request_id in self._peer_ids else "prefill"
            self._peer_ids.discard(request_id)
            self.metrics.receive_started(source, len(receive.block_ids), receive.first_block)
            self.traces.receive_started(
                request_id, source, len(receive.block_ids), receive.first_block
            )
            if self.connector is None:
                self._errors[request_id] = "no KV connector on this worker"
                self.engine.abort_request(request_id)
                self.engine.kv_received(request_id, ok=False)
                continue
            future = Future()
            try:
                # The prompt's first blocks are this worker's own prefix-cache hits: read
                # P's blocks from there on (on every rank: the handles travel as they are).
                wanted = slice_handles(handles, receive.first_block, len(receive.block_ids))
            except ValueError as exc:  # P's handles cover fewer blocks: nothing was read
                self.decline(handles)
                future.set_exception(exc)
            else:
                try:
                    future = self.kv.receive(wanted, receive.block_ids)
                except Exception as exc:
                    future.set_exception(exc)
            self.receives[request_id] = _Receive(
                future,
                first_block=receive.first_block,
                num_blocks=len(receive.block_ids),
                source=source,
            )
            future.add_done_callback(lambda _f: self._wake())
        return len(started)

    def fail(self, request_id: str, error: str) -> None:
        """The request's final event (an abort the caller starts) carries ``error``."""
        self._errors[request_id] = error

    def _reserve(self, receive: KVReceive) -> None:
        """Layer-wise: reserve the request's blocks for the prefill worker's stream."""
        request_id = receive.request_id
        assert self.stream is not None
        self.metrics.receive_started("prefill", len(receive.block_ids), receive.first_block)
        self.traces.receive_started(
            request_id, "prefill", len(receive.block_ids), receive.first_block
        )
        try:
            future = self.stream.reserve(receive)
        except Exception as exc:  # no reservation went out: the router migrates it
            self.stream.forget(request_id)
            self._errors[request_id] = f"cannot reserve KV blocks: {exc}"
            self._retryable.add(request_id)
            self.engine.abort_request(request_id)
            self.engine.kv_received(request_id, ok=False)
            return
        self.receives[request_id] = _Receive(
            future, first_block=receive.first_block, num_blocks=len(receive.block_ids)
        )
        future.add_done_callback(lambda _f: self._wake())

    def finish_receives(self) -> None:
        """Tell the engine of every receive that ended (its blocks are free to use)."""
        if self.stream is not None:
            for request_id, why in self.stream.take_refused():
                self._refuse_stream(request_id, why)
        for request_id, receive in list(self.receives.items()):
            future = receive.future
            if not future.done():
                continue
            if self.stream is not None and not self.stream.ready(request_id, receive.is_cancelled):
                continue  # layer-wise: every layer is in, the first token not yet
            del self.receives[request_id]
            exc = future.exception()
            if exc is None:
                result = future.result()
                self._transfer[request_id] = (result.seconds, result.num_bytes)
                self.metrics.transferred(result.seconds, result.num_bytes)
                self.traces.receive_ended(request_id, result.seconds, result.num_bytes)
                # Every block has the same bytes: what the blocks held here saved.
                saved = result.num_bytes * receive.first_block // receive.num_blocks
                self.bytes_not_received += saved
                self.metrics.receive_saved(receive.source, saved)
                self._peer_pull_ended(receive, "received")
                self.engine.kv_received(request_id, ok=True)
            elif receive.is_cancelled:
                self.traces.receive_ended(request_id, 0.0, 0, error="cancelled")
                self._peer_pull_ended(receive, "unused")
                self.engine.kv_received(request_id, ok=False)  # finished as ABORT
            else:
                self._peer_pull_ended(receive, "recomputed")
                self._transfer_failed(request_id, exc)

    def _refuse_stream(self, request_id: str, why: str) -> None:
        """Layer-wise: a rank of this replica could not reserve (no reservation went
        out): stop every rank's, end the request retryably (the router migrates it)."""
        if request_id not in self.receives:
            return  # ended meanwhile
        self._errors[request_id] = why
        self._retryable.add(request_id)
        self.receives[request_id].is_cancelled = True
        self.kv.withdraw_stream(request_id)  # no writer has them: every rank's ends now
        self.engine.abort_request(request_id)

    def _peer_pull_ended(self, receive: _Receive, result: str) -> None:
        if receive.source == "peer":
            self.metrics.peer_pull(result)

    def _transfer_failed(self, request_id: str, exc: BaseException) -> None:
        self.metrics.transfer_failed("receive")
        req = self.engine.scheduler.requests.get(request_id)
        recompute = self.on_failure == "recompute" or (
            req is not None and not req.is_remote_prefill
        )
        self.traces.receive_ended(request_id, 0.0, 0, error=str(exc), recompute=recompute)
        if recompute:
            # A peer pull (G4) was an optimisation: its prefix is always recomputed here.
            logger.warning("KV transfer of %s failed (%s); recomputing", request_id, exc)
        else:
            self._errors[request_id] = f"KV transfer failed: {exc}"
            self._retryable.add(request_id)  # the router may migrate it
            self.engine.abort_request(request_id)
        self.engine.kv_received(request_id, ok=False)

    # ---- events, and prefill's offers --------------------------------------------------
    def events_of(self, deltas: Sequence[StreamDelta]) -> list[TokenEvent]:
        """The step's events; a finished prefill's waits for its offer (``offered``)."""
        events = []
        for delta in deltas:
            streamed = self.stream.takes(delta) if self.stream is not None else None
            if streamed is not None:
                if delta.request_id in self.traces:
                    self.traces.first_token(delta.request_id)
                events.append(self.with_spans(streamed))
            elif delta.held_block_ids is not None:
                self._offer(delta)
            else:
                events.append(self._event(delta))
        return events

    def _event(self, delta: StreamDelta, kv_handles: tuple[bytes, ...] = ()) -> TokenEvent:
        rid = delta.request_id
        transfer = self._transfer.pop(rid, (0.0, 0))
        error = self._errors.pop(rid, "") if delta.finished else ""
        retryable = bool(error) and rid in self._retryable
        self._retryable.discard(rid)
        event = token_event(
            delta, kv_handles=kv_handles, transfer=transfer, error=error, is_retryable=retryable
        )
        if rid in self.traces:
            if delta.token_ids:
                self.traces.first_token(rid)
            event = self.with_spans(event)
        return event

    def with_spans(self, event: TokenEvent) -> TokenEvent:
        """``event`` with the request's spans on this worker when it is its last here (its
        end, or a prefill's handles); the request is no longer traced here after."""
        if (event.finished or event.kv_handles) and event.request_id in self.traces:
            return replace(event, spans=self.traces.finish(event))
        return event

    def _offer(self, delta: StreamDelta) -> None:
        """Prefill: put the held blocks under a lease on every rank (``offered`` gives
        the event with the handles, one per rank, once every rank has answered)."""
        self.traces.first_token(delta.request_id)
        block_ids = self.handoff.offer(delta.request_id)  # HELD -> OFFERED
        future = self.kv.offer(
            delta.request_id,
            block_ids,
            num_tokens=delta.num_prompt_tokens,
            first_token_id=delta.token_ids[0],
        )
        self.offers[delta.request_id] = (delta, future)

    def offered(self) -> list[TokenEvent]:
        """Events of the offers that completed: the handles, or a failure (blocks freed)."""
        events = []
        for rid, (delta, future) in list(self.offers.items()):
            if not future.done():
                continue
            del self.offers[rid]
            exc = future.exception()
            if exc is None:
                self.handoff.offered(rid)  # -> LEASED: only the lease's end frees the blocks
                events.append(self._event(delta, future.result()))
                continue
            self.handoff.offer_failed(rid)  # no handle went out: the blocks are freed now
            self.metrics.transfer_failed("offer")
            error = f"cannot offer KV: {exc}"
            failed = failed_event(rid, delta.num_prompt_tokens, error, is_retryable=True)
            events.append(self.with_spans(failed))
        return events
