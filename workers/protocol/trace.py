"""A request's trace across processes: W3C trace context in, span records out.

The router owns each request's trace (``router/tracing.py``): it puts the span a worker's
part hangs under into the :class:`~workers.protocol.wire.WorkItem` as a W3C
``traceparent``, and the worker answers with :class:`SpanRecord` s on the request's
final event on that worker (``workers/serving/tracing.py``). Workers do not export:
the router, which alone sees the whole request (an error, its total duration), decides
whether the trace is kept and exports every span of it, so a trace is never cut at the
prefill/decode boundary and its sampling is decided once.

Times are Unix epoch nanoseconds (OpenTelemetry's); span ids are 64-bit, a trace id
128-bit, as in the W3C format.
"""

from __future__ import annotations

import random
import re

import msgspec

# version "00", 32 hex trace id, 16 hex parent span id, 2 hex flags (W3C Trace Context).
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
SAMPLED = 0x01

AttributeValue = str | int | float | bool


class TraceParent(msgspec.Struct, frozen=True):
    """A parsed ``traceparent``: the trace, the parent span, and its flags."""

    trace_id: int
    span_id: int
    flags: int = 0

    @property
    def is_sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def header(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"


def parse_traceparent(value: str) -> TraceParent | None:
    """The ``traceparent`` header's context; None when absent or invalid (W3C: an invalid
    header is ignored and a new trace starts; all-zero ids and upper-case hex are invalid)."""
    found = _TRACEPARENT.match(value.strip()) if value else None
    if found is None:
        return None
    trace_id, span_id = int(found.group(1), 16), int(found.group(2), 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceParent(trace_id, span_id, int(found.group(3), 16))


def new_span_id() -> int:
    """A random non-zero 64-bit span id (not for secrets: ids only need to be unique)."""
    return random.getrandbits(64) or 1


class SpanEventRecord(msgspec.Struct, array_like=True, frozen=True):
    """Something that happened at one moment inside a span (a preemption, a retry)."""

    name: str
    time_ns: int
    attributes: dict[str, AttributeValue] = {}


class SpanRecord(msgspec.Struct, array_like=True, frozen=True):
    """One finished span of a worker, in the trace of the work item it answers."""

    name: str
    span_id: int
    parent_span_id: int
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue] = {}
    events: tuple[SpanEventRecord, ...] = ()
    error: str = ""  # non-empty: the span's status is ERROR with this description
