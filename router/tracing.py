"""One OpenTelemetry trace per request, owned by the router (docs/tracing.md).

The router starts the trace when a request arrives (under the caller's W3C
``traceparent`` when it sent one), records its own phases as spans (``validate``,
``route``, one ``attempt.<mode>`` per worker it submits to, migrations as events), and
gives each worker the attempt span's context in the work item. The workers answer with
span records of their part (queue, prefill, the KV receive, decode:
``workers/serving/tracing.py``) on their last event, which join the trace here. When the
request ends, the whole trace is kept or dropped at once (``router/tracing_keep.py``):
kept are ``sample_ratio`` of traces, those the caller sampled, every failed request and
every one slower than ``slow_threshold_seconds``. Kept traces leave over OTLP/HTTP.

Off (``Tracing`` is None), the router calls :data:`NO_TRACE`'s no-op methods a few
times per request; nothing per token either way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from opentelemetry import trace as otel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from router.requests import GenerateRequest
from router.tracing_keep import KeepProcessor
from workers.protocol.trace import SAMPLED, SpanRecord, TraceParent, parse_traceparent

_RATIO_BITS = 1 << 64
_WORKER_SCOPE = InstrumentationScope("baton.worker")


@dataclass(frozen=True)
class TracingConfig:
    """The ``tracing`` section of the cluster config, resolved (cluster/config_tracing.py)."""

    endpoint: str = "http://127.0.0.1:4318/v1/traces"  # OTLP/HTTP traces endpoint
    sample_ratio: float = 0.01
    slow_threshold_s: float = 10.0  # 0 = no request counts as slow
    include_prompt: bool = False
    service_name: str = "baton"


class Tracing:
    """The router's tracer: its provider, the keep decision, the exporter."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None):
        """``exporter``: where kept spans go (tests pass an in-memory one); None: OTLP/HTTP
        to ``config.endpoint``."""
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.endpoint)
        self.config = config
        self.keep = KeepProcessor(self._inner(exporter))
        resource = Resource.create({"service.name": config.service_name})
        # Every span is recorded; KeepProcessor decides at the end what leaves.
        self.provider = TracerProvider(sampler=ALWAYS_ON, resource=resource)
        self.provider.add_span_processor(self.keep)
        self.tracer = self.provider.get_tracer("baton.router")

    @staticmethod
    def _inner(exporter: SpanExporter) -> SpanProcessor:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        # In memory (tests): at once, so a test sees a trace when its request has ended.
        if isinstance(exporter, InMemorySpanExporter):
            return SimpleSpanProcessor(exporter)
        return BatchSpanProcessor(exporter)

    def start(self, req: GenerateRequest, request_id: str, model: str) -> RequestTrace:
        """The trace of one request, its root span started now."""
        parent = parse_traceparent(req.traceparent)
        context = None
        if parent is not None:
            state = TraceState.from_header([req.tracestate]) if req.tracestate else None
            remote = SpanContext(
                parent.trace_id, parent.span_id, True, TraceFlags(parent.flags), state
            )
            context = otel.set_span_in_context(otel.NonRecordingSpan(remote))
        attributes = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.response.id": request_id,
            "baton.request_id": request_id,
        }
        stopping, sampling = req.stopping, req.sampling
        optional = {
            "gen_ai.request.max_tokens": stopping.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.request.seed": sampling.seed,
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        if self.config.include_prompt and isinstance(req.prompt, str):
            attributes["baton.prompt"] = req.prompt
        root = self.tracer.start_span(
            "baton.request", context=context, kind=SpanKind.SERVER, attributes=attributes
        )
        return RequestTrace(self, root, parent)

    def shutdown(self) -> None:
        """Export what is kept and stop the exporter (the router's drain is over)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's trace: the router's spans and the workers' records of it."""

    def __init__(self, tracing: Tracing, root: otel.Span, parent: TraceParent | None):
        self._tracing = tracing
        self.root = root
        self._caller_sampled = parent is not None and parent.is_sampled
        self._context = otel.set_span_in_context(root)
        self._is_error = False
        self._ended = False
        self._kept = False
        self._worker_records: list[SpanRecord] = []

    @property
    def trace_id(self) -> str:
        """The W3C trace id (32 hex digits), for logs and error bodies."""
        return f"{self.root.get_span_context().trace_id:032x}"

    @contextlib.contextmanager
    def span(self, name: str, **attributes) -> Iterator[otel.Span]:
        """A child span of the request around the block."""
        span = self._tracing.tracer.start_span(name, context=self._context, attributes=attributes)
        try:
            yield span
        except BaseException as exc:
            _ended_by(span, exc)
            raise
        finally:
            span.end()

    @contextlib.contextmanager
    def attempt(self, mode: str, worker: str) -> Iterator[str]:
        """A span around one work item on ``worker``; yields the traceparent the item
        carries (the worker's spans hang under this span)."""
        attributes = {"baton.worker.name": worker, "baton.work.mode": mode}
        span = self._tracing.tracer.start_span(
            f"attempt.{mode}", context=self._context, kind=SpanKind.CLIENT, attributes=attributes
        )
        ctx = span.get_span_context()
        try:
            yield TraceParent(ctx.trace_id, ctx.span_id, SAMPLED).header()
        except BaseException as exc:
            _ended_by(span, exc)
            raise
        finally:
            span.end()

    def event(self, name: str, **attributes) -> None:
        self.root.add_event(name, attributes)

    def set(self, **attributes) -> None:
        self.root.set_attributes(attributes)

    def worker_spans(self, records: Sequence[SpanRecord]) -> None:
        """A worker's spans of this request (from its last event there) join the trace.

        Kept as they came until the decision: a dropped trace's (most, at a low ratio)
        are never turned into SDK spans. One that comes after the decision (a worker's
        last event after an abort was answered) follows it."""
        if not self._ended:
            self._worker_records.extend(records)
        elif self._kept:
            self._tracing.keep.forward(self._sdk_spans(records))

    def _sdk_spans(self, records: Sequence[SpanRecord]) -> list[ReadableSpan]:
        trace_id = self.root.get_span_context().trace_id
        resource = self._tracing.provider.resource
        spans = []
        for rec in records:
            context = SpanContext(trace_id, rec.span_id, False, TraceFlags(SAMPLED))
            parent = SpanContext(trace_id, rec.parent_span_id, False, TraceFlags(SAMPLED))
            status = Status(StatusCode.ERROR, rec.error) if rec.error else Status(StatusCode.UNSET)
            spans.append(
                ReadableSpan(
                    name=rec.name,
                    context=context,
                    parent=parent,
                    resource=resource,
                    attributes=rec.attributes,
                    events=[Event(e.name, e.attributes, e.time_ns) for e in rec.events],
                    kind=SpanKind.INTERNAL,
                    status=status,
                    start_time=rec.start_ns,
                    end_time=rec.end_ns,
                    instrumentation_scope=_WORKER_SCOPE,
                )
            )
        return spans

    def fail(self, error: BaseException | str) -> None:
        """The request failed: its trace is kept whatever the ratio."""
        self._is_error = True
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.root.set_status(Status(StatusCode.ERROR, text))

    def end(self) -> None:
        """The request ended (its client's stream did): decide about the whole trace."""
        if self._ended:
            return
        self._ended = True
        self.root.end()
        ctx = self.root.get_span_context()
        config = self._tracing.config
        start, end = self.root.start_time or 0, self.root.end_time or 0
        is_slow = config.slow_threshold_s > 0 and (end - start) >= config.slow_threshold_s * 1e9
        by_ratio = (ctx.trace_id & (_RATIO_BITS - 1)) < config.sample_ratio * _RATIO_BITS
        keep = self._caller_sampled or self._is_error or is_slow or by_ratio
        self._kept = keep
        self._tracing.keep.decide(ctx.trace_id, keep)
        if keep:
            self._tracing.keep.forward(self._sdk_spans(self._worker_records))
        self._worker_records = []


class _NoTrace:
    """Tracing off: the same calls, doing nothing."""

    trace_id = ""

    @contextlib.contextmanager
    def span(self, name: str, **attributes) -> Iterator[None]:
        yield None

    @contextlib.contextmanager
    def attempt(self, mode: str, worker: str) -> Iterator[str]:
        yield ""

    def event(self, name: str, **attributes) -> None:
        pass

    def set(self, **attributes) -> None:
        pass

    def worker_spans(self, records: Sequence[SpanRecord]) -> None:
        pass

    def fail(self, error: BaseException | str) -> None:
        pass

    def end(self) -> None:
        pass


NO_TRACE = _NoTrace()


def _ended_by(span: otel.Span, exc: BaseException) -> None:
    """Mark ``span`` with why its block ended early: the client leaving or a cancel is no
    error of the request's; anything else is."""
    if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
        span.add_event("cancelled")
    else:
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
