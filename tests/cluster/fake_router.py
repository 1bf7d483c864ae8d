"""A fake ``baton.v1.Inference`` servicer on loopback, standing in for router/server.py:
it records each request, streams two Deltas and a Final, and answers errors with the
status codes the real one uses (docs/serving.md, "A request"). The ``server`` / ``stub``
fixtures (conftest.py) serve it.
"""

import socket
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

STATUS = pb.ClusterStatus(
    model="tiny-llama",
    kv_transfer_backend="local",
    policy="kv_aware",
    disaggregation="auto",
    draining=False,
    pools=[
        pb.PoolStatus(
            role="prefill",
            replicas=1,
            healthy_replicas=1,
            workers=[
                pb.WorkerStatus(
                    name="prefill-0",
                    role="prefill",
                    healthy=True,
                    tensor_parallel=2,
                    pipeline_parallel=1,
                    num_running=3,
                    num_waiting=1,
                    kv_blocks_total=1024,
                    kv_blocks_used=128,
                    kv_blocks_cached=256,
                )
            ],
        ),
        pb.PoolStatus(
            role="decode",
            replicas=2,
            healthy_replicas=1,
            workers=[
                pb.WorkerStatus(
                    name="decode-0",
                    role="decode",
                    healthy=True,
                    tensor_parallel=1,
                    pipeline_parallel=1,
                    num_running=17,
                    num_incoming=5,
                    kv_blocks_total=400,
                    kv_blocks_used=100,
                ),
                pb.WorkerStatus(name="decode-1", role="decode", healthy=False),
            ],
        ),
    ],
)
TIMING = pb.Timing(
    queue_seconds=0.001,
    prefill_seconds=0.012,
    kv_transfer_seconds=0.002,
    kv_transfer_bytes=3 * 1024 * 1024,
    ttft_seconds=0.02,
    e2e_seconds=0.25,
    prefill_worker="prefill-0",
    decode_worker="decode-0",
)


class FakeInference(pb_grpc.InferenceServicer):
    """Records requests; prompts steer it: '' is invalid, 'slow' waits to be cancelled."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        self.requests.append(request)
        if request.WhichOneof("prompt") is None or request.text == "":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: the prompt is empty")
        if request.text == "busy":
            context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode workers")
        if request.text == "slow":
            context.add_callback(self.cancelled.set)
            yield pb.GenerateResponse(request_id="r-slow", delta=pb.Delta(token_ids=[1], text="a"))
            self.cancelled.wait(10)
            return
        yield pb.GenerateResponse(request_id="r1", delta=pb.Delta(token_ids=[5], text="Hello"))
        yield pb.GenerateResponse(request_id="r1", delta=pb.Delta(token_ids=[6, 7], text=", wor"))
        final = pb.Final(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=4, completion_tokens=4, cached_prompt_tokens=2),
            delta=pb.Delta(token_ids=[8], text="ld"),
        )
        if request.output.return_timing:
            final.timing.CopyFrom(TIMING)
        yield pb.GenerateResponse(request_id="r1", final=final)

    def GetClusterStatus(self, request, context):
        return STATUS


@dataclass
class FakeServer:
    target: str
    servicer: FakeInference
    health: health.HealthServicer


def closed_port() -> int:
    # Bound then closed: nothing listens there, so a connection is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
