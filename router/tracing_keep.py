"""Which traces are exported: decided once per trace, when its request has ended.

A head sampler (OpenTelemetry's ``TraceIdRatioBased``) decides when a request starts,
before anyone knows whether it will fail or be slow. The router records every span of a
traced request instead, holds them here until the request ends, and then keeps the whole
trace or none of it (:meth:`KeepProcessor.decide`): kept are a ``sample_ratio`` share of
traces (by trace id, so it is the same share any W3C-aware peer would pick), every trace
the caller sampled, every request that failed and every one slower than the threshold
(``router/tracing.py`` says which). Router spans that end after the decision follow it;
the workers' spans of a trace are held by its ``RequestTrace`` and come through
:meth:`KeepProcessor.forward` once it is kept. Memory is bounded: past
``max_pending_spans`` the oldest undecided trace is dropped and counted.

Runs on the router's event loop (spans end there); the exporter behind ``inner`` (a
``BatchSpanProcessor``) sends from its own thread.
"""

from __future__ import annotations

from collections import OrderedDict

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

_DECISIONS_KEPT = 65536  # remembered for late spans: far more than requests in flight


class KeepProcessor(SpanProcessor):
    """Buffers each trace's ended spans until :meth:`decide`, then forwards or drops them."""

    def __init__(self, inner: SpanProcessor, max_pending_spans: int = 200_000):
        self.inner = inner
        self.max_pending_spans = max_pending_spans
        self._pending: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
        self._num_pending = 0
        self._decided: OrderedDict[int, bool] = OrderedDict()
        self.num_kept = 0  # traces
        self.num_dropped = 0  # traces: not kept, or pushed out undecided
        self.num_overflowed = 0  # of those, pushed out undecided (too many spans held)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        trace_id = span.context.trace_id
        decided = self._decided.get(trace_id)
        if decided is not None:
            if decided:
                self.inner.on_end(span)
            return
        self._pending.setdefault(trace_id, []).append(span)
        self._num_pending += 1
        while self._num_pending > self.max_pending_spans and len(self._pending) > 1:
            _, spans = self._pending.popitem(last=False)
            self._num_pending -= len(spans)
            self.num_dropped += 1
            self.num_overflowed += 1

    def decide(self, trace_id: int, keep: bool) -> None:
        """The request of ``trace_id`` ended: export its spans (``keep``) or drop them, and
        treat its later spans the same way."""
        spans = self._pending.pop(trace_id, [])
        self._num_pending -= len(spans)
        self._decided[trace_id] = keep
        if len(self._decided) > _DECISIONS_KEPT:
            self._decided.popitem(last=False)
        if keep:
            self.num_kept += 1
            for span in spans:
                self.inner.on_end(span)
        else:
            self.num_dropped += 1

    def forward(self, spans: list[ReadableSpan]) -> None:
        """Export ``spans`` of a kept trace (its workers' spans, made only once it is)."""
        for span in spans:
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
