"""One request's trace while it runs: light span records, made OpenTelemetry spans only if kept.

Every request of a traced router is recorded, whatever the sampling ratio, because whether
its trace is kept is decided when it ends (it failed, it was slow: ``router/tracing.py``).
So recording must be cheap: a span here is a slotted object with two clock readings, its
attributes and events (:class:`Span`); attributes that cost something to compute (the
route's candidate scores) are given as a function, called only for a kept trace. The
workers' span records (``workers/serving/tracing.py``) are held as they came. Only a kept
trace becomes the SDK's ``ReadableSpan`` s, handed to the exporter's processor; a dropped
one is garbage at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from workers.protocol.trace import SAMPLED, SpanRecord, TraceParent, new_span_id

if TYPE_CHECKING:
    from router.tracing import Tracing

_RATIO_BITS = 1 << 64
_ROUTER_SCOPE = InstrumentationScope("baton.router")
_WORKER_SCOPE = InstrumentationScope("baton.worker")
_UNSET = Status(StatusCode.UNSET)
# W3C trace context's tracestate: at most 32 ``key=value`` members (OpenTelemetry's grammar).
_TRACESTATE_KEY = (
    r"[a-z][_0-9a-z\-\*\/]{0,255}|[a-z0-9][_0-9a-z\-\*\/]{0,240}@[a-z][_0-9a-z\-\*\/]{0,13}"
)
_TRACESTATE_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_TRACESTATE_MEMBER = re.compile(f"({_TRACESTATE_KEY})=({_TRACESTATE_VALUE})")
_MAX_TRACESTATE_MEMBERS = 32
_MAX_TRACESTATE_LEN = 32 * (256 + 1 + 256) + 31  # 32 members of the longest, with commas


class Span:
    """A span of the router's, recorded cheaply (converted only when its trace is kept)."""

    __slots__ = ("attributes", "end_ns", "error", "events", "kind", "lazy", "name")
    __slots__ += ("parent_id", "span_id", "start_ns")

    def __init__(
        self, name: str, parent_id: int, kind: SpanKind = SpanKind.INTERNAL, attributes=None
    ):
        self.name = name
        self.span_id = new_span_id()
        self.parent_id = parent_id
        self.kind = kind
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.attributes: dict[str, Any] = attributes or {}
        self.events: list[tuple[str, int, dict[str, Any]]] = []
        self.error = ""
        self.lazy: Callable[[], dict[str, Any]] | None = None

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)

    def set_lazy_attributes(self, compute: Callable[[], dict[str, Any]]) -> None:
        """Attributes computed only if the trace is kept (and when it ends)."""
        self.lazy = compute

    def add_event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        self.events.append((name, time.time_ns(), attributes or {}))

    def end(self) -> None:
        if not self.end_ns:
            self.end_ns = time.time_ns()


class RequestTrace:
    """One request's trace: the router's spans and the workers' records of it."""

    def __init__(
        self,
        tracing: Tracing,
        trace_id: int,
        parent: TraceParent | None,
        tracestate: str,
        attributes: dict[str, Any],
    ):
        self._tracing = tracing
        self._trace_id = trace_id
        self._parent = parent
        self._state = trace_state(tracestate)
        self.root = Span("baton.request", parent.span_id if parent else 0, SpanKind.SERVER)
        self.root.attributes = attributes
        self._spans = [self.root]
        self._worker_records: list[SpanRecord] = []
        self._is_error = False
        self._ended = False
        self._kept = False
        self._offer_span_id = 0

    @property
    def trace_id(self) -> str:
        """The W3C trace id (32 hex digits), for logs and error bodies."""
        return f"{self._trace_id:032x}"

    @contextlib.contextmanager
    def span(self, name: str, **attributes) -> Iterator[Span]:
        """A child span of the request around the block."""
        span = Span(name, self.root.span_id, attributes=attributes)
        self._spans.append(span)
        try:
            yield span
        except BaseException as exc:
            _ended_by(span, exc)
            raise
        finally:
            span.end()

    def open_attempt(self, mode: str, worker: str) -> tuple[Span, str]:
        """A span around one work item on ``worker``, ended by ``close_attempt``; returns
        it and the traceparent the item carries (the worker's spans hang under it)."""
        attributes = {"baton.worker.name": worker, "baton.work.mode": mode}
        span = Span(f"attempt.{mode}", self.root.span_id, SpanKind.CLIENT, attributes)
        self._spans.append(span)
        return span, TraceParent(self._trace_id, span.span_id, SAMPLED).header()

    def close_attempt(self, span: Span, exc: BaseException | None = None) -> None:
        """End an ``open_attempt`` span; ``exc``: what ended its work item early."""
        if exc is not None:
            _ended_by(span, exc)
        span.end()

    def event(self, name: str, **attributes) -> None:
        self.root.add_event(name, attributes)

    def set(self, **attributes) -> None:
        self.root.set_attributes(attributes)

    def worker_spans(self, records: Sequence[SpanRecord]) -> None:
        """A worker's spans of this request (from its last event there) join the trace;
        one that comes after the decision (a worker's last event after an abort was
        answered) follows it."""
        for rec in records:
            if rec.name == "kv.offer":  # the receive will link to it (the hand-off's two ends)
                self._offer_span_id = rec.span_id
        if not self._ended:
            self._worker_records.extend(records)
        elif self._kept:
            self._tracing.export([self._from_record(r) for r in records])

    def fail(self, error: BaseException | str) -> None:
        """The request failed: its trace is kept whatever the ratio."""
        self._is_error = True
        self.root.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def end(self) -> None:
        """The request ended (its client's stream did): keep the whole trace or drop it."""
        if self._ended:
            return
        self._ended = True
        self.root.end()
        config = self._tracing.config
        slow_ns = config.slow_threshold_s * 1e9
        is_slow = slow_ns > 0 and self.root.end_ns - self.root.start_ns >= slow_ns
        by_ratio = (self._trace_id & (_RATIO_BITS - 1)) < config.sample_ratio * _RATIO_BITS
        by_caller = self._parent is not None and self._parent.is_sampled
        self._kept = by_caller or self._is_error or is_slow or by_ratio
        if self._kept:
            spans = [self._from_span(s) for s in self._spans]
            spans += [self._from_record(r) for r in self._worker_records]
            self._tracing.export(spans)
            self._tracing.num_kept += 1
        else:
            self._tracing.num_dropped += 1
        self._spans, self._worker_records = [], []

    # ---- kept: OpenTelemetry's spans -------------------------------------------------------
    def _context(self, span_id: int, is_remote: bool = False) -> SpanContext:
        return SpanContext(self._trace_id, span_id, is_remote, TraceFlags(SAMPLED), self._state)

    def _from_span(self, span: Span) -> ReadableSpan:
        parent = None
        if span.parent_id:  # the root's is the caller's span, in another process
            parent = self._context(span.parent_id, is_remote=span is self.root)
        attributes = span.attributes | span.lazy() if span.lazy else span.attributes
        return ReadableSpan(
            name=span.name,
            context=self._context(span.span_id),
            parent=parent,
            resource=self._tracing.resource,
            attributes=attributes,
            events=[Event(name, attrs, t) for name, t, attrs in span.events],
            kind=span.kind,
            status=Status(StatusCode.ERROR, span.error) if span.error else _UNSET,
            start_time=span.start_ns,
            end_time=span.end_ns or time.time_ns(),
            instrumentation_scope=_ROUTER_SCOPE,
        )

    def _from_record(self, rec: SpanRecord) -> ReadableSpan:
        links = ()
        if rec.name == "kv.receive" and self._offer_span_id:
            links = (Link(self._context(self._offer_span_id)),)
        return ReadableSpan(
            name=rec.name,
            context=self._context(rec.span_id),
            parent=self._context(rec.parent_span_id),
            resource=self._tracing.resource,
            attributes=rec.attributes,
            events=[Event(e.name, e.attributes, e.time_ns) for e in rec.events],
            links=links,
            kind=SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, rec.error) if rec.error else _UNSET,
            start_time=rec.start_ns,
            end_time=rec.end_ns,
            instrumentation_scope=_WORKER_SCOPE,
        )


def trace_state(header: str) -> TraceState | None:
    """The caller's ``tracestate`` header; None when absent or invalid (W3C: an invalid
    one is dropped whole, as are more than 32 members). Not OpenTelemetry's
    ``TraceState.from_header``: that logs an invalid member whole, so a caller's megabyte
    of junk became a megabyte warning in the router's log on every request."""
    if not header or len(header) > _MAX_TRACESTATE_LEN:
        return None
    pairs: dict[str, str] = {}
    for member in header.split(","):
        member = member.strip(" \t")
        if not member:
            continue  # empty members are allowed
        found = _TRACESTATE_MEMBER.fullmatch(member)
        if found is None or found[1] in pairs or len(pairs) == _MAX_TRACESTATE_MEMBERS:
            return None
        pairs[found[1]] = found[2]
    return TraceState(list(pairs.items())) if pairs else None


def _ended_by(span: Span, exc: BaseException) -> None:
    """Mark ``span`` with why its block ended early: the client leaving or a cancel is no
    error of the request's; anything else is."""
    if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
        span.add_event("cancelled")
    else:
        span.error = f"{type(exc).__name__}: {exc}"
