"""The transport side of one worker's layer-wise hand-offs (docs/kvtransfer.md).

The flow (the router drives it: ``router/layerwise.py``): the decode worker is asked
first (``WorkItem.kv_stream_from``); it admits the request, whose first token is not
known yet, and once the engine gave it blocks (RECEIVING) it reserves them for the
stream (``expect_stream``) and answers with the reservation
(``TokenEvent.kv_reservations``). The prefill worker gets the request with it
(``WorkItem.kv_reservations``), writes each layer group into those blocks as its forward
pass stores it (``LLMEngine.layerwise.open``), and answers with the first token
(``TokenEvent.kv_streamed``); the router brings the decode worker that token (a second
work item), and the request decodes once both the token and every layer are in (the
stream's future). A failed stream is recomputed there, as a failed read is.

Who frees what: the engine's ``KVHandoff`` (prefill: the blocks stay held, also past the
request's end, until the stream's future completes: ``stream_ended``; decode: the
blocks are the request's, RECEIVING until the future completes). Loop thread only.

TP/PP replicas: every call goes through ``ReplicaKV`` (``workers/parallel/``): each
decode rank reserves on its own connector, and the reservations go to the router once
every rank has one (``poll``); each prefill rank writes its own heads of its own layers,
and the stream's future completes once every rank's has.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from msgspec.structs import replace

from kvtransfer import KVConnector
from workers.engine.handoff import HandoffState, KVReceive
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StreamDelta
from workers.parallel.replica_kv import ReplicaKV
from workers.protocol.wire import TokenEvent, WorkItem
from workers.serving.events import token_event
from workers.serving.layerwise_stats import LayerwiseStats
from workers.serving.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Out:
    """Prefill: a stream in flight (its future completes once no write is in flight)."""

    future: Future
    last_posted: float = 0.0  # perf_counter of the last write (link numbers)
    last_bytes: int = 0
    ended_at: float = 0.0


@dataclass
class _In:
    """Decode: a request that waits for its stream and its first token."""

    source: str  # the prefill worker's name
    has_first_token: bool = False


class StreamTransport:
    def __init__(
        self,
        engine: LLMEngine,
        connector: KVConnector | None,
        stats: LayerwiseStats | None,
        wake,
        metrics: WorkerMetrics | None = None,
        kv: ReplicaKV | None = None,
    ):
        self.engine = engine
        self.connector = connector
        if kv is None:  # one rank: the connector alone
            kv = ReplicaKV()
            kv.bind(connector, lambda rid, reason: None, wake)
        self.kv = kv  # every stream spans all ranks of the replica
        kv.bind_streams(engine.layerwise)
        self.stats = stats  # prefill with kv_transfer.layerwise auto: the numbers
        self._wake = wake
        self.metrics = metrics
        self.outs: dict[str, _Out] = {}  # prefill: streams in flight
        self._streamed: set[str] = set()  # prefill: first token not out yet
        self.incoming: dict[str, _In] = {}  # decode: reserved, until the receive ends
        # decode: every rank's reservations, until all came (a replica of several ranks)
        self._reserving: dict[str, Future] = {}
        self.refused: list[tuple[str, str]] = []  # decode: a rank could not reserve
        self.events: list[TokenEvent] = []  # for the loop to publish
        self.num_opened = 0  # prefill: streams opened since start (tests, stats)
        self.num_reserved = 0  # decode: reservations made since start
        kv = engine.kv_cache
        self.block_layer_bytes = kv[0, 0].numel() * kv.element_size() if kv.dim() > 2 else 0

    @property
    def is_pending(self) -> bool:
        return bool(self.outs)

    # ---- prefill -----------------------------------------------------------------------
    def open(self, item: WorkItem) -> None:
        """A prefill request with the decode worker's reservations: admit it streaming."""
        if self.connector is None:
            raise ValueError("no KV connector on this worker")
        rid = item.request_id
        num_layers = self.engine.layerwise.num_layers
        group = self.stats.group_size(len(item.prompt_token_ids)) if self.stats else num_layers
        try:
            future: Future | None = self.kv.open_stream(rid, item.kv_reservations, group)
        except Exception as exc:  # (an unknown reader): its deadline ends its wait
            logger.warning(
                "cannot stream the KV of %s (%s): the decode worker recomputes", rid, exc
            )
            future = None
        try:
            prompt = list(item.prompt_token_ids)
            self.engine.add_request(prompt, item.params, rid, prefill_only=True)
        except Exception:
            if future is not None:
                self.kv.abandon_stream(rid, "refused")  # the reader recomputes
            raise
        self._streamed.add(rid)  # its first token's event says kv_streamed either way
        if future is None:
            return
        out = _Out(future)
        connector, per_block = self.connector, self.block_layer_bytes

        def write(first_block, block_ids, layers, layers_ready, is_last):
            if is_last:
                out.last_posted = time.perf_counter()
                out.last_bytes = len(block_ids) * per_block * (layers[1] - layers[0])
            connector.write_layers(rid, first_block, block_ids, layers, layers_ready, is_last)

        def ended(_f: Future) -> None:
            out.ended_at = time.perf_counter()
            self._wake()

        self.engine.layerwise.open(rid, group, write)
        self.outs[rid] = out
        self.num_opened += 1
        future.add_done_callback(ended)

    def takes(self, delta: StreamDelta) -> TokenEvent | None:
        """A prefill delta of a streamed request whose part here is over: its event
        (the first token, ``kv_streamed``), or None for a delta not of a stream's."""
        rid = delta.request_id
        if rid not in self._streamed or not delta.finished:
            return None
        self._streamed.discard(rid)
        if delta.held_block_ids is None:
            return None  # the first token ended it: a plain final (its blocks: STREAMING)
        if rid not in self.outs:  # the stream ended (failed) while it computed
            self.engine.release_held(rid)
        return replace(token_event(delta), kv_streamed=True)

    def abort(self, rid: str) -> None:
        """An abort of a request that may still compute: its stream stops (the reader
        hears "failed"); its blocks stay until the stream's future completes."""
        if rid in self.outs and self.connector is not None:
            self.engine.layerwise.remove(rid)
            self.kv.abandon_stream(rid, "aborted")

    def poll(self) -> None:
        """Streams whose future completed: nothing reads their blocks any more. Decode:
        reservations every rank has made go out; those a rank could not make are
        ``refused`` (the caller aborts the request on every rank)."""
        for rid, reserving in list(self._reserving.items()):
            if reserving.done():
                del self._reserving[rid]
                self._reserved(rid, reserving)
        for rid, out in list(self.outs.items()):
            if not out.future.done():
                continue
            del self.outs[rid]
            self.engine.layerwise.ended(rid)  # frees them if the request is no longer here
            if self.metrics is not None:
                self.metrics.stream_ended(out.future.exception() is None)
            if out.future.exception() is not None:
                logger.warning("layer-wise stream of %s failed: %s", rid, out.future.exception())
            elif self.stats is not None and out.last_posted:
                self.stats.observe_link(out.last_bytes, out.ended_at - out.last_posted)

    # ---- decode ------------------------------------------------------------------------
    def expect(self, item: WorkItem) -> None:
        """Admit a decode request whose KV will stream from ``item.kv_stream_from``."""
        rid = item.request_id
        self.engine.add_request(
            list(item.prompt_token_ids), item.params, rid, await_first_token=True
        )
        self.incoming[rid] = _In(item.kv_stream_from)

    def first_token(self, item: WorkItem) -> bool:
        """The second work item of a streamed request: its first token. False when this
        worker has no such request waiting (it ended here already)."""
        inc = self.incoming.get(item.request_id)
        if inc is None or inc.has_first_token or item.first_token_id is None:
            return False
        self.engine.set_remote_first_token(item.request_id, item.first_token_id)
        inc.has_first_token = True
        return True

    def reserve(self, receive: KVReceive) -> Future:
        """The engine gave the request blocks: reserve them for the prefill worker's
        stream; the reservation goes to the router. Raises when that is impossible."""
        rid = receive.request_id
        if self.connector is None:
            raise ValueError("no KV connector on this worker")
        source = self.incoming[rid].source
        reserving, future = self.kv.expect_stream(
            rid, receive.block_ids, source, first_block=receive.first_block
        )
        self.num_reserved += 1
        if reserving.done():
            self._reserved(rid, reserving)
        else:
            self._reserving[rid] = reserving
        return future

    def _reserved(self, rid: str, reserving: Future) -> None:
        if rid not in self.incoming or self.engine.handoff.state(rid) is HandoffState.ABORTING:
            return  # ended here meanwhile: no prefill worker may write into these blocks
        exc = reserving.exception()
        if exc is not None:
            self.refused.append((rid, f"cannot reserve KV blocks: {exc}"))
            return
        self.events.append(TokenEvent(rid, (), False, kv_reservations=reserving.result()))

    def take_refused(self) -> list[tuple[str, str]]:
        refused, self.refused = self.refused, []
        return refused

    def ready(self, rid: str, is_cancelled: bool) -> bool:
        """Whether a completed receive may be reported to the engine: a streamed request
        needs its first token first (unless it was aborted)."""
        inc = self.incoming.get(rid)
        if inc is None:
            return True
        aborted = is_cancelled or self.engine.handoff.state(rid) is HandoffState.ABORTING
        if inc.has_first_token or aborted:
            del self.incoming[rid]
            return True
        return False

    def forget(self, rid: str) -> None:
        self.incoming.pop(rid, None)
        self._reserving.pop(rid, None)

    def take_events(self) -> list[TokenEvent]:
        events, self.events = self.events, []
        return events
