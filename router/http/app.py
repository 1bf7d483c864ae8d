"""The FastAPI app: OpenAI's routes over one :class:`~router.router.Router`.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
(503 while draining), ``GET /version``, and the admin routes ``/admin/scale`` (``admin.py``:
live scaling, behind the admin key). Each generation route converts its body into the
router's typed requests (``convert.py``), runs them through ``Router.generate`` like the
gRPC servicer does (``streams.Choices``) and renders the events (``render.py``, ``render_chat.py``). Every
error is OpenAI's shape (``errors.py``): a body pydantic refuses, malformed JSON, a body
over the size limit and unknown routes included.

Before any route, a pure-ASGI guard (``_Guard``) refuses what must not be read: a body
over ``max_body_bytes`` (413, counted as it arrives, whatever Content-Length says) and,
with an API key, a ``/v1`` request without ``Authorization: Bearer <key>`` (401; compared
in constant time so that response times do not leak how much of a guess was right).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.auth import ANONYMOUS, ApiKeys
from router.errors import ErrorCode, RouterError
from router.http import render, render_chat
from router.http.admin import ADMIN_PREFIX, AdminKey, add_admin_routes, admin_refusal
from router.http.chat_template import ChatTemplate
from router.http.convert import Plan, chat_plan, completion_plan
from router.http.errors import OpenAIError, from_router_error, model_not_found
from router.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    HealthInfo,
    ModelCard,
    ModelList,
    StreamOptions,
    VersionInfo,
)
from router.http.streams import Choices, ClientGone, EventStreamResponse, unless_disconnected
from router.metrics import RouterMetrics
from router.quotas import QuotaExceeded
from router.requests import GenerateRequest
from router.router import Router

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20  # a 1M-token prompt as JSON token ids fits (gRPC allows 64 MiB)
# Starlette's own refusals (a body over the limit while it is read, unknown routes).
_HTTP_CODES = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}
_CLIENT_CLOSED = 499
_GENERATION_ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions"}
)  # nginx's status for a client that went away; nobody receives it


def create_app(
    router: Router,
    *,
    chat_template: ChatTemplate | None = None,
    keys: ApiKeys | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    version: str = "0.0.0",
    admin_key: AdminKey | None = None,
) -> ASGIApp:
    """The app (FastAPI behind the guard); it answers 503 once the router drains. Without
    ``admin_key`` the admin routes answer 403."""
    app = FastAPI(title="Baton", version=version, docs_url=None, redoc_url=None)
    model = router.config.model_name
    metrics = RouterMetrics(model, frontend="http")

    def count_refusal(request: Request) -> None:
        """A generation request the adapter refused before the router saw it (a body
        pydantic refused, an unknown model, an option Baton lacks): counted as the router
        counts its own refusals, as gRPC's INVALID_ARGUMENT."""
        if request.url.path in _GENERATION_ROUTES:
            metrics.call().error(ErrorCode.INVALID_ARGUMENT)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        if not exc.is_from_router:
            count_refusal(request)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_refusal(request)
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code)
        if exc.status_code == 400 and exc.__cause__ is not None:
            # FastAPI's "There was an error parsing the body": say why (not UTF-8, an
            # integer past Python's 4300 digits).
            count_refusal(request)
            cause = exc.__cause__
            return OpenAIError(400, f"the body is not valid JSON: {cause}").response()
        return OpenAIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # The exception's text stays in the log (it may hold internals: paths, addresses,
        # another request's data); the client gets an id to quote.
        error_id = uuid.uuid4().hex
        logger.error("request failed [error %s]", error_id, exc_info=exc)
        message = f"internal error {error_id} (the server's log has the details)"
        return OpenAIError(500, message, "internal_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if router.is_draining or router.is_stopped:
            info = HealthInfo(status="draining", fault_injection=router.config.fault_injection)
            return JSONResponse(info.model_dump(exclude_defaults=True), status_code=503)
        # `fault_injection` only when on: a production body stays {"status": "ok"}.
        info = HealthInfo(status="ok", fault_injection=router.config.fault_injection)
        return JSONResponse(info.model_dump(exclude_defaults=True))

    @app.get("/version")
    async def get_version() -> VersionInfo:
        return VersionInfo(version=version)

    @app.get("/v1/models")
    async def models() -> ModelList:
        cfg = router.config
        card = ModelCard(id=model, max_model_len=cfg.max_model_len, vocab_size=cfg.vocab_size)
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model, model)
        answer_id = f"cmpl-{uuid.uuid4().hex}"
        plan = completion_plan(body, answer_id, router.tokenizer)
        return await _answer(request, plan, answer_id, body.stream, body.stream_options, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model, model)
        answer_id = f"chatcmpl-{uuid.uuid4().hex}"
        principal = getattr(request.state, "principal", ANONYMOUS)
        plan = chat_plan(
            body, answer_id, chat_template, router.tokenizer, lambda: _admissible(principal.name)
        )
        return await _answer(request, plan, answer_id, body.stream, body.stream_options, chat=True)

    def _admissible(key: str) -> None:
        """Refuse now what admission would refuse (the router's admit still decides)."""
        try:
            router.quotas.check(key)
        except QuotaExceeded as exc:
            metrics.call().error(ErrorCode.RESOURCE_EXHAUSTED)  # as the router counts its own
            error = RouterError(ErrorCode.RESOURCE_EXHAUSTED, exc.message)
            error.retry_after_s = exc.retry_after_s
            raise from_router_error(error, {}) from None

    async def _answer(
        request: Request,
        plan: Plan,
        answer_id: str,
        stream: bool,
        options: StreamOptions | None,
        chat: bool,
    ) -> Response:
        """Run the plan's choices; one JSON answer, or an event stream."""
        include_usage = bool(stream and options is not None and options.include_usage)
        answer = render.Answer(answer_id, model, plan, router.tokenizer, include_usage)
        principal = getattr(request.state, "principal", ANONYMOUS)
        requests = with_trace_context(plan.requests, request.headers)
        requests = [
            dataclasses.replace(r, principal=principal.name, tenant=principal.tenant)
            for r in requests
        ]
        choices = Choices(router, requests, metrics)
        try:
            # Refusals come before the status line: every choice's first event first.
            await unless_disconnected(request.receive, choices.start())
            if stream:
                events = render_chat.chat_events if chat else render.completion_events
                return EventStreamResponse(events(answer, choices))
            respond = render_chat.chat_response if chat else render.completion_response
            try:
                body = await unless_disconnected(request.receive, respond(answer, choices))
            finally:
                await choices.aclose()
            return JSONResponse(body.model_dump())
        except RouterError as exc:
            raise from_router_error(exc, plan.names) from None
        except ClientGone:
            return Response(status_code=_CLIENT_CLOSED)

    add_admin_routes(app, router)
    return _Guard(app, keys, max_body_bytes, admin_key)


def with_trace_context(
    reqs: Sequence[GenerateRequest], headers: Mapping[str, str]
) -> Sequence[GenerateRequest]:
    """The plan's requests with the caller's W3C ``traceparent`` / ``tracestate`` headers
    (each choice of ``n`` is a request of its own, in the same trace's parent)."""
    parent, state = headers.get("traceparent", ""), headers.get("tracestate", "")
    if not parent:
        return reqs
    return [dataclasses.replace(r, traceparent=parent, tracestate=state) for r in reqs]


def _check_model(requested: str | None, served: str) -> None:
    if requested and requested != served:
        raise model_not_found(requested, served)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint, naming the field as ``messages[0].role``."""
    error = exc.errors()[0]
    loc = [p for p in error.get("loc", ()) if p != "body"]
    if error.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {error.get('msg')}")
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _is_union_tag(str(part)):
            break  # pydantic names the union member it tried: no field of the body
        else:
            param += f".{part}" if param else str(part)
    if not param:  # the body as a whole: not an object (or not sent as JSON)
        return OpenAIError(400, f"the body must be a JSON object: {error.get('msg')}")
    return OpenAIError(400, f"{param}: {error.get('msg')}", param=param)


def _is_union_tag(part: str) -> bool:
    """A union member in pydantic's error location (``str``, ``list[int]``, ``TextPart``)."""
    return part in _TYPE_NAMES or "[" in part or part[:1].isupper()


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


MAX_HEADER_BYTES = 64 * 1024  # all header names and values of one request


class _Guard:
    """Pure ASGI, ahead of FastAPI: the body-size limit and the API keys (router/auth.py).
    The caller's principal goes into the request's state (``request.state.principal``)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys | None,
        max_body_bytes: int,
        admin_key: AdminKey | None = None,
    ):
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.admin_key = admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope["headers"]
        if sum(len(k) + len(v) for k, v in raw) > MAX_HEADER_BYTES:
            # uvicorn's httptools parser has no bound of its own (h11's is 16 KiB).
            error = OpenAIError(
                431, f"the request's headers are larger than {MAX_HEADER_BYTES} bytes"
            )
            await error.response()(scope, receive, send)
            return
        headers = dict(raw)
        principal = ANONYMOUS
        if self.keys is not None and scope["path"].startswith("/v1"):
            # One Authorization header: of several, a proxy in front may check another
            # one than the one we would.
            sent = [v for k, v in raw if k == b"authorization"]
            found = self.keys.authenticate(sent[0]) if len(sent) == 1 else None
            if found is None:
                error = OpenAIError(
                    401, "missing or incorrect API key", code="invalid_api_key", param=None
                )
                await error.response()(scope, receive, send)
                return
            principal = found
        path = scope["path"]
        if path == ADMIN_PREFIX or path.startswith(f"{ADMIN_PREFIX}/"):
            refusal = admin_refusal(raw, self.admin_key)  # the admin key, not an API key
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        scope.setdefault("state", {})["principal"] = principal
        limit = self.max_body_bytes
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            await OpenAIError(400, "Content-Length: not a number").response()(scope, receive, send)
            return
        if int(length) > limit:
            await _too_large(limit).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a chunked body, or more than Content-Length said
                raise HTTPException(413, _too_large(limit).info.message)
            return message

        await self.app(scope, limited, send)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the body is larger than {limit} bytes", code="request_too_large")
