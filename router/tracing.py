"""One OpenTelemetry trace per request, owned by the router (docs/tracing.md).

The router starts the trace when a request arrives (under the caller's W3C
``traceparent`` when it sent one), records its own phases as spans (``validate``,
``route``, one ``attempt.<mode>`` per worker it submits to, migrations as events), and
gives each worker the attempt span's context in the work item. The workers answer with
span records of their part (queue, prefill, the KV receive, decode:
``workers/serving/tracing.py``) on their last event, which join the trace here. When the
request ends, the whole trace is kept or dropped at once (``router/request_trace.py``):
kept are ``sample_ratio`` of traces (by trace id, as OpenTelemetry's ``TraceIdRatioBased``
picks them), those the caller sampled, every failed request and every one slower than
``slow_threshold_seconds``. A head sampler could not keep the last two: it decides before
anyone knows. Kept traces leave over OTLP/HTTP from the SDK's batch processor.

Off (``Tracing`` is None), the router calls :data:`NO_TRACE`'s no-op methods a few times
per request; nothing per token either way.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.request_trace import RequestTrace
from router.requests import GenerateRequest
from workers.protocol.trace import SpanRecord, parse_traceparent


@dataclass(frozen=True)
class TracingConfig:
    """The ``tracing`` section of the cluster config, resolved (cluster/config_tracing.py)."""

    endpoint: str = "http://127.0.0.1:4318/v1/traces"  # OTLP/HTTP traces endpoint
    sample_ratio: float = 0.01
    slow_threshold_s: float = 10.0  # 0 = no request counts as slow
    include_prompt: bool = False
    service_name: str = "baton"


class Tracing:
    """The router's tracer: starts each request's trace, exports the kept ones."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None):
        """``exporter``: where kept spans go (tests pass an in-memory one, exported at once);
        None: OTLP/HTTP to ``config.endpoint``, in batches from the SDK's thread."""
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.endpoint)
        self.config = config
        self.processor: SpanProcessor = (
            SimpleSpanProcessor(exporter)
            if isinstance(exporter, InMemorySpanExporter)
            else BatchSpanProcessor(exporter)
        )
        self.resource = Resource.create({"service.name": config.service_name})
        self.num_kept = 0  # traces
        self.num_dropped = 0

    def start(self, req: GenerateRequest, request_id: str, model: str) -> RequestTrace:
        """The trace of one request, its root span started now."""
        parent = parse_traceparent(req.traceparent)
        trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
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
        tracestate = req.tracestate if parent is not None else ""
        return RequestTrace(self, trace_id, parent, tracestate, attributes)

    def export(self, spans: Sequence[ReadableSpan]) -> None:
        for span in spans:
            self.processor.on_end(span)

    def shutdown(self) -> None:
        """Export what is kept and stop the exporter (the router's drain is over)."""
        self.processor.shutdown()


class _NoTrace:
    """Tracing off: the same calls, doing nothing."""

    trace_id = ""

    @contextlib.contextmanager
    def span(self, name: str, **attributes) -> Iterator[None]:
        yield None

    def open_attempt(self, mode: str, worker: str) -> tuple[None, str]:
        return None, ""

    def close_attempt(self, span: None, exc: BaseException | None = None) -> None:
        pass

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
