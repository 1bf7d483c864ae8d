"""The gRPC front door: ``baton.v1.Inference`` over a :class:`~router.router.Router`,
plus the standard health service and server reflection.

The servicer is a thin adapter: it maps ``RouterError`` codes to gRPC status codes and
makes sure a cancelled or timed-out call closes the request's stream (which aborts it on
the workers). Health: ``""`` is SERVING while the process is up; ``baton.v1.Inference``
is SERVING once the workers reported and NOT_SERVING while draining.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from router.config import RouterError
from router.metrics import RouterMetrics
from router.router import Router
from router.status import cluster_status, model_info

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "baton.v1.Inference"
_MAX_MESSAGE_BYTES = 64 * 2**20  # a 1M-token prompt as token ids fits


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, router: Router, tp_pp: dict[str, tuple[int, int]] | None = None):
        self.router = router
        self.tp_pp = tp_pp or {}
        self.metrics = RouterMetrics(router.config.model_name)

    async def Generate(self, request, context):
        call = self.metrics.call()
        stream = self.router.generate(request)
        try:
            async for message in stream:
                call.message(message)
                yield message
        except RouterError as exc:
            call.error(exc.code)
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        except Exception as exc:  # a bug: answer INTERNAL, keep serving
            call.error("INTERNAL")
            await _internal(context, exc)
        finally:
            call.closed()  # no Final and no error: the client cancelled or its deadline passed
            await stream.aclose()  # cancelled or deadline: aborts the request on the workers

    async def Abort(self, request, context):
        try:
            found = await self.router.abort(request.request_id)
        except Exception as exc:
            await _internal(context, exc)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request, context):
        try:
            return model_info(self.router)
        except Exception as exc:
            await _internal(context, exc)

    async def GetClusterStatus(self, request, context):
        try:
            return cluster_status(self.router, self.tp_pp)
        except Exception as exc:
            await _internal(context, exc)


async def _internal(context, exc: Exception) -> None:
    """A bug: answer INTERNAL (not UNKNOWN) and keep serving."""
    logger.exception("request failed")
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class Server:
    """The async gRPC server of one router."""

    def __init__(
        self,
        router: Router,
        host: str,
        port: int,
        tp_pp: dict[str, tuple[int, int]] | None = None,
    ):
        self.router = router
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(router, tp_pp), self.server)
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
