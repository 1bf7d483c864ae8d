"""How the router refuses or fails a request: :class:`RouterError` with an :class:`ErrorCode`.

The codes are gRPC's status names (the gRPC edge, ``router/server.py``, answers with the
status of the same name); another front end maps them to its own statuses.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # malformed; the message names the field
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # too many requests in flight: retry later
    UNAVAILABLE = "UNAVAILABLE"  # draining, no healthy worker, or a worker refused the work
    INTERNAL = "INTERNAL"  # a worker failed the request, or a bug
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # past router.request_(idle_)timeout_seconds


class RouterError(Exception):
    """A request the router refuses or cannot finish."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
        # The request's trace (32 hex digits) when tracing is on, for error bodies and
        # logs: the one place to look for what happened to it (router/tracing.py).
        self.trace_id = ""
        # RESOURCE_EXHAUSTED by a quota: when a retry can pass (HTTP Retry-After).
        self.retry_after_s: float | None = None
