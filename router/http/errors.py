"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status OpenAI (and vLLM) answer.

The router's refusals (``RouterError``) name the field by its path in the typed request
(``sampling.top_p: ...``, the documented contract of ``router/validation.py``); here that
path becomes the OpenAI body's field name (``top_p``), in ``param`` and in the message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fastapi.responses import JSONResponse

from router.errors import ErrorCode, RouterError
from router.http.schemas import ErrorInfo, ErrorResponse
from router.validation import clip

# ErrorCode -> (HTTP status, OpenAI error type). 429 and 503 tell clients to retry later
# (the openai client retries both by default).
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.INTERNAL: (500, "internal_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_CODES = {
    ErrorCode.RESOURCE_EXHAUSTED: "too_many_requests",
    ErrorCode.UNAVAILABLE: "service_unavailable",
}

# Paths of the typed request that are the same for both endpoints.
_COMMON_PATHS = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.min_p": "min_p",
    "sampling.seed": "seed",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "stopping.min_tokens": "min_tokens",
    "stopping.stop": "stop",
    "stopping.stop_token_ids": "stop_token_ids",
    "stopping.ignore_eos": "ignore_eos",
    "sampling.logit_bias": "logit_bias",
    "model": "model",
    "disaggregation": "disaggregation",
}


def field_names(prompt: str, max_tokens: str, logprobs: str) -> dict[str, str]:
    """Typed-request path -> the endpoint's OpenAI field: where its prompt, max_tokens and
    logprobs came from (``messages``, ``max_completion_tokens``, ``top_logprobs`` for chat)."""
    return {
        **_COMMON_PATHS,
        "prompt": prompt,
        "text": prompt,
        "token_ids": prompt,
        "stopping.max_tokens": max_tokens,
        "output.logprobs": logprobs,
    }


class OpenAIError(Exception):
    """An HTTP error answer; raised by the adapter, rendered by the app's handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.is_from_router = False  # a RouterError's: the router's metrics counted it
        self.trace_id = ""  # the request's trace (tracing on): in the body, to look it up
        self.retry_after_s: float | None = None  # a 429's: the Retry-After header

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info).model_dump()
        if self.trace_id:
            body["error"]["trace_id"] = self.trace_id
        headers = None
        if self.retry_after_s is not None:  # whole seconds (RFC 9110), at least 1
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_field(param: str, message: str) -> OpenAIError:
    """400 naming ``param`` (an OpenAI body field) first, as the router's messages do."""
    return OpenAIError(400, f"{param}: {message}", param=param)


def from_router_error(exc: RouterError, names: Mapping[str, str]) -> OpenAIError:
    """The HTTP answer to a refusal; ``names`` maps typed paths to OpenAI fields."""
    status, kind = _STATUS[exc.code]
    message, param, code = exc.message, None, _CODES.get(exc.code)
    if exc.code is ErrorCode.INVALID_ARGUMENT:
        path, sep, rest = exc.message.partition(": ")
        if sep and path in names:
            param = names[path]
            message = f"{param}: {rest}"
        if "max_model_len" in rest:  # validation.check_length: the context is too short
            code = "context_length_exceeded"
    error = OpenAIError(status, message, kind, param, code)
    error.is_from_router = True
    error.trace_id = exc.trace_id
    error.retry_after_s = exc.retry_after_s
    return error


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"model: the model {clip(model)} does not exist (serving {served!r})",
        param="model",
        code="model_not_found",
    )
