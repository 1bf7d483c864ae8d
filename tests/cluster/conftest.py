"""Fixtures of the client tests: the fake router on a loopback port and a stub for it."""

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.client import (
    SERVICE_NAME,
)
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

from .fake_router import FakeInference, FakeServer


@pytest.fixture
def server():
    servicer = FakeInference()
    health_servicer = health.HealthServicer()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_InferenceServicer_to_server(servicer, grpc_server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield FakeServer(f"127.0.0.1:{port}", servicer, health_servicer)
    servicer.cancelled.set()  # release a 'slow' handler a failed test left waiting
    grpc_server.stop(grace=None)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel)
