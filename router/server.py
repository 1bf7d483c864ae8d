"""The gRPC front door: ``baton.v1.Inference`` over a :class:`~router.router.Router`,
plus the standard health service and server reflection.

The only module of the router that knows protobuf. The servicer is a thin adapter: it
converts ``GenerateRequest`` into the router's typed request (``router/requests.py``), the
router's events (``router/events.py``) and status snapshots (``router/status.py``) into
protobuf messages, maps ``RouterError`` codes to gRPC status codes, and makes sure a
cancelled or timed-out call closes the request's stream (which aborts it on the
workers). Health: ``""`` is SERVING while the process is up; ``baton.v1.Inference`` is
SERVING once the workers reported and NOT_SERVING while draining.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from router import events, requests, status
from router.auth import ANONYMOUS, ApiKeys, Principal
from router.errors import ErrorCode, RouterError
from router.metrics import RouterMetrics
from router.router import Router
from router.tls import TlsFiles
from workers.protocol.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "baton.v1.Inference"
_MAX_MESSAGE_BYTES = 64 * 2**20  # a 1M-token prompt as token ids fits
_MAX_DETAILS_LEN = 1000  # characters of a status message (UTF-8: at most 4 KB)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(
        self,
        router: Router,
        tp_pp: dict[str, tuple[int, int]] | None = None,
        keys: ApiKeys | None = None,
    ):
        """``keys``: every call needs one of them (metadata ``authorization: Bearer KEY``),
        else UNAUTHENTICATED; None: the service is open (health and reflection always are)."""
        self.router = router
        self.tp_pp = tp_pp or {}
        self.keys = keys
        self.metrics = RouterMetrics(router.config.model_name, frontend="grpc")

    async def _caller(self, context) -> Principal:
        """The authenticated caller; answers UNAUTHENTICATED (and raises) otherwise."""
        if self.keys is None:
            return ANONYMOUS
        metadata = context.invocation_metadata() or ()
        # One authorization entry: of several, a proxy may check another than we would.
        sent = [value for key, value in metadata if key == "authorization"]
        found = self.keys.authenticate(sent[0]) if len(sent) == 1 else None
        if found is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or incorrect API key")
        return found

    async def Generate(self, request, context):
        caller = await self._caller(context)
        call = self.metrics.call()
        stream = None
        try:
            if isinstance(request, Malformed):
                raise RouterError(ErrorCode.INVALID_ARGUMENT, request.message)
            typed = with_trace_context(generate_request(request), context.invocation_metadata())
            typed = dataclasses.replace(typed, principal=caller.name, tenant=caller.tenant)
            stream = self.router.generate(typed)
            async for event in stream:
                call.event(event)
                yield generate_response(event)
        except RouterError as exc:
            call.error(exc.code)
            trailers = []
            if exc.trace_id:  # where to look for what happened (tracing on)
                trailers.append(("baton-trace-id", exc.trace_id))
            if exc.retry_after_s is not None:  # a quota's: when a retry can pass
                trailers.append(("retry-after", str(max(1, math.ceil(exc.retry_after_s)))))
            if trailers:
                context.set_trailing_metadata(tuple(trailers))
            await context.abort(GRPC_STATUS[exc.code], status_details(exc.message))
        except Exception as exc:  # a bug: answer INTERNAL, keep serving
            call.error(ErrorCode.INTERNAL)
            await _internal(context, exc)
        finally:
            call.closed()  # no Final and no error: the client cancelled or its deadline passed
            if stream is not None:  # cancelled or deadline: aborts the request on the workers
                await stream.aclose()

    async def Abort(self, request, context):
        caller = await self._caller(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            # Only the caller's own: another's request answers found=false, as if absent.
            found = await self.router.abort(request.request_id, caller.name)
        except Exception as exc:
            await _internal(context, exc)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request, context):
        await self._caller(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return model_info_message(status.model_info(self.router))
        except Exception as exc:
            await _internal(context, exc)

    async def GetClusterStatus(self, request, context):
        await self._caller(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return cluster_status_message(status.cluster_status(self.router, self.tp_pp))
        except Exception as exc:
            await _internal(context, exc)


async def _internal(context, exc: Exception) -> None:
    """A bug: answer INTERNAL (not UNKNOWN) and keep serving. The exception's text stays
    in the log (it may hold internals); the client gets an id to quote."""
    error_id = uuid.uuid4().hex
    logger.exception("request failed [error %s]", error_id)
    message = f"internal error {error_id} (the server's log has the details)"
    await context.abort(grpc.StatusCode.INTERNAL, message)


def status_details(message: str) -> str:
    """The message, cut to fit: status details travel in the trailers, and a client drops
    a call whose trailers pass 16 KiB (RESOURCE_EXHAUSTED "metadata size exceeds hard
    limit") instead of reporting the refusal."""
    if len(message) <= _MAX_DETAILS_LEN:
        return message
    return message[:_MAX_DETAILS_LEN] + f"... ({len(message)} characters)"


@dataclasses.dataclass(frozen=True)
class Malformed:
    """What arrived instead of a request message: bytes protobuf cannot parse (a string
    field that is not UTF-8, a length past the end). The servicer answers
    INVALID_ARGUMENT; grpc's own deserializer would fail the call as UNKNOWN."""

    message: str


def _parse(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as exc:  # DecodeError, or whatever else the parser raises
            reason = str(exc).rpartition(": ")[2] or type(exc).__name__
            return Malformed(f"request: not a valid {message_type.DESCRIPTOR.full_name}: {reason}")

    return parse


def add_servicer(servicer: InferenceServicer, server) -> None:
    """``pb_grpc.add_InferenceServicer_to_server`` with lenient request parsing."""
    methods = {
        "Generate": (grpc.unary_stream_rpc_method_handler, pb.GenerateRequest),
        "Abort": (grpc.unary_unary_rpc_method_handler, pb.AbortRequest),
        "GetModelInfo": (grpc.unary_unary_rpc_method_handler, pb.GetModelInfoRequest),
        "GetClusterStatus": (grpc.unary_unary_rpc_method_handler, pb.GetClusterStatusRequest),
    }
    declared = {m.name for m in pb.DESCRIPTOR.services_by_name["Inference"].methods}
    if declared != set(methods):  # a new rpc in proto/: add it above
        raise RuntimeError(f"Inference declares {sorted(declared)}, served {sorted(methods)}")
    handlers = {
        name: handler(
            getattr(servicer, name),
            request_deserializer=_parse(request_type),
            response_serializer=lambda message: message.SerializeToString(),
        )
        for name, (handler, request_type) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# ---- protobuf <-> the router's types -----------------------------------------------------

GRPC_STATUS = {code: getattr(grpc.StatusCode, code.value) for code in ErrorCode}
_DISAGGREGATION: dict[int, requests.Disaggregation | None] = {
    pb.DISAGGREGATION_UNSPECIFIED: None,
    pb.DISAGGREGATION_ALWAYS: "always",
    pb.DISAGGREGATION_NEVER: "never",
    pb.DISAGGREGATION_AUTO: "auto",
}
_FINISH_REASON = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# The optional scalars (logit_bias is a map: converted on its own).
_SAMPLING_FIELDS = tuple(
    f.name for f in dataclasses.fields(requests.SamplingOptions) if f.name != "logit_bias"
)


def _optional(message, name: str):
    """A proto3 ``optional`` field's value, or None when the client left it unset."""
    return getattr(message, name) if message.HasField(name) else None


def with_trace_context(
    req: requests.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]] | None
) -> requests.GenerateRequest:
    """``req`` with the caller's W3C trace context from the call's metadata (gRPC
    metadata keys are lower case: ``traceparent``, ``tracestate``)."""
    found = {k: v for k, v in metadata or () if k in ("traceparent", "tracestate")}
    if not found:
        return req
    text = {k: v.decode("latin-1") if isinstance(v, bytes) else v for k, v in found.items()}
    return dataclasses.replace(
        req, traceparent=text.get("traceparent", ""), tracestate=text.get("tracestate", "")
    )


def generate_request(req: pb.GenerateRequest) -> requests.GenerateRequest:
    """The router's request; values are judged by the router (``router/validation.py``).

    Raises RouterError(INVALID_ARGUMENT) only for what the typed request cannot hold: a
    ``disaggregation`` enum value this server does not know.
    """
    if req.disaggregation not in _DISAGGREGATION:
        raise RouterError(
            ErrorCode.INVALID_ARGUMENT,
            f"disaggregation: unknown value {req.disaggregation}",
        )
    kind = req.WhichOneof("prompt")  # an explicitly empty text is set, and refused later
    prompt: str | tuple[int, ...] | None = None
    if kind == "text":
        prompt = req.text
    elif kind == "token_ids":
        prompt = tuple(req.token_ids.ids)
    sampling, stopping, output = req.sampling, req.stopping, req.output
    return requests.GenerateRequest(
        prompt=prompt,
        request_id=req.request_id,
        model=req.model,
        sampling=requests.SamplingOptions(
            **{name: _optional(sampling, name) for name in _SAMPLING_FIELDS},
            logit_bias=tuple(sorted(sampling.logit_bias.items())),
        ),
        stopping=requests.StoppingOptions(
            max_tokens=_optional(stopping, "max_tokens"),
            min_tokens=_optional(stopping, "min_tokens"),
            stop=tuple(stopping.stop),
            stop_token_ids=tuple(stopping.stop_token_ids),
            ignore_eos=stopping.ignore_eos,
        ),
        output=requests.OutputOptions(
            logprobs=_optional(output, "logprobs"),
            prompt_logprobs=_optional(output, "prompt_logprobs"),
            return_text=output.return_text if output.HasField("return_text") else True,
            return_timing=output.return_timing,
        ),
        disaggregation=_DISAGGREGATION[req.disaggregation],
        cache_salt=req.cache_salt,
        structured=_structured(req.structured) if req.HasField("structured") else None,
    )


def _structured(msg: pb.StructuredOutput) -> requests.StructuredOptions | None:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None  # an empty message: no constraint
    if msg.lenient and kind != "json_schema":
        raise RouterError(
            ErrorCode.INVALID_ARGUMENT, f"structured.lenient: applies to json_schema, not {kind}"
        )
    if kind == "choice":
        return requests.StructuredOptions("choice", choices=tuple(msg.choice.choices))
    if kind == "json_object":
        if not msg.json_object:  # set, but false: neither a constraint nor an absence
            raise RouterError(
                ErrorCode.INVALID_ARGUMENT, "structured.json_object: true, or another constraint"
            )
        return requests.StructuredOptions("json_object")
    return requests.StructuredOptions(kind, getattr(msg, kind), strict=not msg.lenient)


def generate_response(event: events.GenerateEvent) -> pb.GenerateResponse:
    delta = _delta(event.delta)
    finish = event.finish
    if finish is None:
        return pb.GenerateResponse(request_id=event.request_id, delta=delta)
    final = pb.Final(
        finish_reason=_FINISH_REASON[finish.reason],
        usage=pb.Usage(
            prompt_tokens=finish.usage.prompt_tokens,
            completion_tokens=finish.usage.completion_tokens,
            cached_prompt_tokens=finish.usage.cached_prompt_tokens,
        ),
        delta=delta,
    )
    if finish.stop_string is not None:  # stop_reason is a oneof
        final.stop_string = finish.stop_string
    elif finish.stop_token_id is not None:
        final.stop_token_id = finish.stop_token_id
    if finish.timing is not None:
        final.timing.CopyFrom(pb.Timing(**dataclasses.asdict(finish.timing)))
    return pb.GenerateResponse(request_id=event.request_id, final=final)


def _delta(delta: events.Delta) -> pb.Delta:
    message = pb.Delta(token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs or delta.prompt_logprobs is not None:  # most chunks: neither (cheaper)
        message.logprobs.extend(map(_token_logprob, delta.logprobs))
        message.prompt_logprobs.extend(map(_token_logprob, delta.prompt_logprobs or ()))
        message.prompt_token_ids.extend(delta.prompt_token_ids)
    return message


def _token_logprob(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[
            pb.TopLogprob(token_id=t, logprob=v)
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ],
    )


def model_info_message(info: status.ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**dataclasses.asdict(info))


def cluster_status_message(snapshot: status.ClusterStatus) -> pb.ClusterStatus:
    # Field for field: the snapshot's dataclasses mirror the messages.
    return pb.ClusterStatus(**dataclasses.asdict(snapshot))


class Server:
    """The async gRPC server of one router."""

    def __init__(
        self,
        router: Router,
        host: str,
        port: int,
        tp_pp: dict[str, tuple[int, int]] | None = None,
        keys: ApiKeys | None = None,
        tls: TlsFiles | None = None,
        reuse_port: bool = False,
    ):
        """``keys``: the API keys every call of the inference service needs (router/auth.py);
        ``tls``: serve over TLS (router/tls.py) instead of plaintext; ``reuse_port``:
        share the port with the other router processes (SO_REUSEPORT, ``router.processes``)."""
        self.router = router
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", int(reuse_port)),
            ]
        )
        add_servicer(InferenceServicer(router, tp_pp, keys), self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls is not None:
            self.port = self.server.add_secure_port(address, tls.grpc_credentials())
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s on %s", SERVICE_NAME, self.address)

    async def drain(self, grace_s: float) -> int:
        """Readiness goes NOT_SERVING, new requests get UNAVAILABLE, running ones finish
        within ``grace_s`` (then are aborted). Returns how many were aborted."""
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        return await self.router.drain(grace_s)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
