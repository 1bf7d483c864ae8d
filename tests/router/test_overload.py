"""Overload (issue 25): past ``router.max_queued_requests`` requests in flight, a new one
is refused at once, RESOURCE_EXHAUSTED over gRPC and 429 over HTTP, with a message naming
the setting, while the admitted ones finish. Real front ends and router; the workers hold
every request until the test lets them go (bench/overload.py measures it on a cluster).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import pytest

from cluster.tools.make_model import build_tokenizer
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from router.router import Router
from tests.router.fuzz_harness import WireWorker, fuzz_router, serve_grpc
from tests.router.http_harness import serve
from workers.protocol.wire import WorkItem
from workers.text.tokenizer import Tokenizer

LIMIT = 4


class GatedWorker(WireWorker):
    """Prefills only once the gate opens: requests stay in flight until then."""

    gate: asyncio.Event | None = None

    async def _generate(self, item: WorkItem) -> None:
        if self.gate is None:
            self.gate = asyncio.Event()
        await self.gate.wait()
        await super()._generate(item)


def gated_router() -> tuple[Router, GatedWorker]:
    tokenizer = Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))
    base = fuzz_router(tokenizer)
    prefill = GatedWorker("prefill-0", "prefill", base.prefill[0].client.output_ids)
    decode = WireWorker("decode-0", "decode", prefill.output_ids)  # after the prefill
    config = base.config.__class__(**{**base.config.__dict__, "max_queued_requests": LIMIT})
    return Router(config, tokenizer, [prefill], [decode]), prefill


def wait_in_flight(router: Router, n: int) -> None:
    deadline = time.monotonic() + 30
    while router.num_in_flight < n:
        assert time.monotonic() < deadline, f"{router.num_in_flight} of {n} admitted"
        time.sleep(0.01)


def open_gate(loop: asyncio.AbstractEventLoop, worker: GatedWorker) -> None:
    async def go() -> None:
        if worker.gate is None:
            worker.gate = asyncio.Event()
        worker.gate.set()

    asyncio.run_coroutine_threadsafe(go(), loop).result(10)


@pytest.fixture
def grpc_served():
    router, prefill = gated_router()
    with serve_grpc(router) as served:
        yield served, prefill


def test_grpc_past_the_limit_is_resource_exhausted_and_admitted_ones_finish(grpc_served):
    served, prefill = grpc_served
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        req = pb.GenerateRequest(text="Once upon a time")
        req.stopping.max_tokens = 3
        admitted = [stub.Generate(req, timeout=60) for _ in range(LIMIT)]
        wait_in_flight(served.router, LIMIT)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(req, timeout=60))
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"router.max_queued_requests={LIMIT}" in refused.value.details()
        open_gate(served.loop, prefill)
        for call in admitted:
            assert list(call)[-1].final.usage.completion_tokens == 3


def test_http_past_the_limit_is_429_and_admitted_ones_finish():
    router, prefill = gated_router()
    parts = (router, prefill, router.decode[0].client, [])
    with serve(parts) as served, httpx.Client(base_url=served.url, timeout=60) as client:
        body = {"prompt": "Once upon a time", "max_tokens": 3}
        with ThreadPoolExecutor(LIMIT) as pool:
            admitted = [
                pool.submit(client.post, "/v1/completions", json=body) for _ in range(LIMIT)
            ]
            wait_in_flight(router, LIMIT)
            for _ in range(3):
                refused = client.post("/v1/completions", json=body)
                assert refused.status_code == 429, refused.text
                error = refused.json()["error"]
                assert error["type"] == "rate_limit_error"
                assert f"router.max_queued_requests={LIMIT}" in error["message"]
            open_gate(served.loop, prefill)
            for answer in admitted:
                assert answer.result().json()["usage"]["completion_tokens"] == 3
