"""A worker's part of traced requests, as span records on their last event here.

A work item with a ``traceparent`` (the router's tracing is on) is traced on this worker:
its phases are read off timestamps the engine and the hand-off keep anyway (admission,
first scheduling, the first token, the receive's start and end), and when the request's
part here ends (its final event, or a prefill's handle event) they become
:class:`~workers.protocol.trace.SpanRecord` s on that event, parented to the router's span
of this attempt. Nothing is recorded per step and nothing is exported from here: the
router keeps or drops the whole trace (``router/tracing.py``). A request without a
traceparent costs one dictionary lookup per event.

The span tree of one worker's part (docs/tracing.md)::

    worker.prefill | worker.decode | worker.full
      queue            admitted -> first scheduled (full, prefill)
      kv.alloc_wait    admitted -> blocks given to receive into (decode, peer pull)
      kv.receive       the receive: bytes, blocks, source; recompute on failure
      prefill          first scheduled -> first token: chunks, cached and computed tokens
      kv.onboard       prompt blocks copied in from the KV tiers (when any)
      kv.offer         first token -> the handles are out (prefill)
      decode           first token -> the end: tokens, preemptions, speculative
                       proposals and acceptances (full, decode)

Called on the worker's engine loop thread only (``workers/serving/service.py``,
``handoff_transport.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from workers.engine.request import Request
from workers.protocol.trace import (
    AttributeValue,
    SpanEventRecord,
    SpanRecord,
    new_span_id,
    parse_traceparent,
)
from workers.protocol.wire import TokenEvent, WorkItem


def _now_ns() -> int:
    return time.time_ns()


@dataclass
class _Trace:
    """One traced request on this worker: its context and the moments seen so far."""

    trace_id: int
    parent_span_id: int
    mode: str
    num_prompt_tokens: int
    admitted_ns: int = field(default_factory=_now_ns)
    span_id: int = field(default_factory=new_span_id)
    req: Request | None = None  # the engine's, from its first scheduling on
    scheduled_ns: int = 0
    first_token_ns: int = 0
    receive: tuple[int, int] | None = None  # (start, end) ns of the KV receive
    receive_attrs: dict[str, AttributeValue] = field(default_factory=dict)
    receive_error: str = ""
    receive_events: list[SpanEventRecord] = field(default_factory=list)
    events: list[SpanEventRecord] = field(default_factory=list)


class WorkerTraces:
    """The traced requests of one worker, by request id."""

    def __init__(self, worker: str, role: str):
        self.worker = worker
        self.role = role
        self._traces: dict[str, _Trace] = {}
        # The engine stamps with time.monotonic(); spans carry Unix epoch nanoseconds.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._traces

    def __len__(self) -> int:
        return len(self._traces)

    def admitted(self, item: WorkItem) -> None:
        """A work item was admitted: trace it when it carries a (valid) traceparent."""
        parent = parse_traceparent(item.traceparent)
        if parent is not None:
            self._traces[item.request_id] = _Trace(
                parent.trace_id, parent.span_id, item.mode, len(item.prompt_token_ids)
            )

    def first_scheduled(self, req: Request) -> None:
        """The scheduler's hook: ``req`` left the queue (for a decode item: got its blocks)."""
        trace = self._traces.get(req.request_id)
        if trace is not None and req.first_scheduled_time is not None:
            trace.req = req
            trace.scheduled_ns = self._wall_ns(req.first_scheduled_time)

    def first_token(self, request_id: str) -> None:
        """The request's first token here (a prefill's is the one it hands off)."""
        trace = self._traces.get(request_id)
        if trace is not None and not trace.first_token_ns:
            trace.first_token_ns = _now_ns()

    def receive_started(self, request_id: str, source: str, num_blocks: int, first_block: int):
        trace = self._traces.get(request_id)
        if trace is not None:
            trace.receive = (_now_ns(), 0)
            trace.receive_attrs = {
                "baton.kv.source": source,
                "baton.kv.blocks": num_blocks,
                "baton.kv.blocks_held": first_block,
            }

    def receive_ended(
        self, request_id: str, seconds: float, num_bytes: int, error: str = "", recompute=False
    ) -> None:
        """The receive ended: ``error`` empty when the KV arrived (``seconds``, ``num_bytes``
        as the connector measured them); ``recompute``: the prompt is computed here instead."""
        trace = self._traces.get(request_id)
        if trace is None or trace.receive is None:
            return
        end = _now_ns()
        trace.receive = (trace.receive[0], end)
        trace.receive_attrs["baton.kv.bytes"] = num_bytes
        trace.receive_attrs["baton.kv.transfer_seconds"] = seconds
        trace.receive_error = error
        if recompute:
            trace.receive_events.append(SpanEventRecord("kv.recompute", end, {"error": error}))

    def event(self, request_id: str, name: str, **attributes: AttributeValue) -> None:
        trace = self._traces.get(request_id)
        if trace is not None:
            trace.events.append(SpanEventRecord(name, _now_ns(), dict(attributes)))

    def discard(self, request_id: str) -> None:
        self._traces.pop(request_id, None)

    def finish(self, event: TokenEvent) -> tuple[SpanRecord, ...]:
        """The spans of the request's part here, now that ``event`` ends it (forgotten
        after); () for a request not traced."""
        trace = self._traces.pop(event.request_id, None)
        if trace is None:
            return ()
        end = _now_ns()
        parent = trace.span_id
        spans: list[SpanRecord] = []
        # The first scheduling never came (aborted or failed while queued): up to the end.
        scheduled = trace.scheduled_ns or end
        first = trace.first_token_ns or end
        if trace.mode == "decode":
            received_at = trace.receive[1] if trace.receive and trace.receive[1] else scheduled
            spans.append(self._span("kv.alloc_wait", parent, trace.admitted_ns, scheduled))
        else:
            spans.append(self._span("queue", parent, trace.admitted_ns, scheduled))
        if trace.receive is not None:
            start, stop = trace.receive
            spans.append(
                self._span(
                    "kv.receive",
                    parent,
                    start,
                    stop or end,
                    trace.receive_attrs,
                    trace.receive_events,
                    error=trace.receive_error,
                )
            )
            if trace.mode != "decode":  # a peer pull's wait for blocks, before the receive
                spans.insert(-1, self._span("kv.alloc_wait", parent, trace.admitted_ns, start))
        req = trace.req
        if req is not None and req.onboard_ns is not None:  # from the KV tiers (G2, G3)
            start, stop = req.onboard_ns
            onboarded = {"baton.kv.onboarded_tokens": req.num_onboarded_tokens}
            spans.append(self._span("kv.onboard", parent, start, stop, onboarded))
        if trace.mode != "decode":
            attrs: dict[str, AttributeValue] = {
                "baton.prefill.chunks": req.num_prefill_chunks if req else 0,
                "baton.cached_tokens": event.num_cached_tokens,
                "baton.computed_tokens": trace.num_prompt_tokens - event.num_cached_tokens,
            }
            spans.append(self._span("prefill", parent, scheduled, first, attrs))
        if trace.mode == "prefill":
            attrs = {"baton.kv.handles": len(event.kv_handles)}
            spans.append(self._span("kv.offer", parent, first, end, attrs))
        else:
            start = first if trace.mode == "full" else received_at
            events = []
            if trace.mode == "decode" and trace.first_token_ns:
                events.append(SpanEventRecord("first_step", trace.first_token_ns))
            attrs = {
                "baton.decode.tokens": req.num_output_tokens if req else 0,
                "baton.preemptions": req.num_preemptions if req else 0,
            }
            if req is not None and req.num_spec_proposed:  # speculative decoding's verify
                attrs["baton.spec.proposed_tokens"] = req.num_spec_proposed
                attrs["baton.spec.accepted_tokens"] = req.num_spec_accepted
            spans.append(self._span("decode", parent, min(start, end), end, attrs, events))
        worker_attrs: dict[str, AttributeValue] = {
            "baton.worker.name": self.worker,
            "baton.worker.role": self.role,
            "baton.work.mode": trace.mode,
            "gen_ai.usage.input_tokens": trace.num_prompt_tokens,
        }
        if event.finish_reason:
            worker_attrs["baton.finish_reason"] = event.finish_reason
        spans.append(
            SpanRecord(
                f"worker.{trace.mode}",
                trace.span_id,
                trace.parent_span_id,
                trace.admitted_ns,
                end,
                worker_attrs,
                tuple(trace.events),
                error=event.error,
            )
        )
        return tuple(spans)

    def _span(
        self,
        name: str,
        parent: int,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, AttributeValue] | None = None,
        events: list[SpanEventRecord] | None = None,
        error: str = "",
    ) -> SpanRecord:
        return SpanRecord(
            name,
            new_span_id(),
            parent,
            start_ns,
            max(start_ns, end_ns),
            attributes or {},
            tuple(events or ()),
            error,
        )

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns
