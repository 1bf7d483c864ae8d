"""Routing under bursts, through the router's own bookkeeping (no engine, no gRPC).

A request counts against the workers it was routed to from the moment of routing (the
decode worker while the request is still in prefill elsewhere), so the requests of a
burst, routed before any worker reported, spread; and it stops counting on every end
path: finish, abort, a failure on the worker, a refused submit, the worker lost, a
restart. The workers are manual fakes: nothing happens on them until the test says so,
and their reports always say they are idle (the burst is ahead of every report).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from cluster.tools.make_model import build_tokenizer
from router.config import RouterConfig
from router.errors import RouterError
from router.requests import GenerateRequest, SamplingOptions, StoppingOptions
from router.router import Router
from router.status import cluster_status
from workers.protocol.wire import OutputBatch, TokenEvent, WorkerReport, WorkItem
from workers.text.tokenizer import Tokenizer

PROMPT = "Once upon a time there lived a curious engineer"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


class ManualWorker:
    """A WorkerClient that only records work; the test sends its events."""

    def __init__(self, name: str, role: str):
        self.name, self.role = name, role
        self.items: dict[str, WorkItem] = {}
        self.refuse = False  # submit raises
        self.on_batch = self.on_lost = None

    async def start(self) -> None: ...

    def listen(self, on_batch, on_lost) -> None:
        self.on_batch, self.on_lost = on_batch, on_lost
        self.send()

    def close(self) -> None: ...

    async def submit(self, item: WorkItem) -> None:
        if self.refuse:
            raise RuntimeError("refused")
        self.items[item.request_id] = item

    async def abort(self, request_id: str) -> None:
        if request_id in self.items:
            self.send(TokenEvent(request_id, (), True, "abort"))

    async def decline(self, handles) -> None: ...

    def send(self, *events: TokenEvent) -> None:
        report = WorkerReport(self.name, self.role, True, 0, 0, 64, 0, 0, 0, "")
        self.on_batch(OutputBatch(events, report))


def make_router(tokenizer, num_decode=2, policy="kv_aware", disaggregation="always"):
    prefill = ManualWorker("prefill-0", "prefill")
    decode = [ManualWorker(f"decode-{i}", "decode") for i in range(num_decode)]
    cfg = RouterConfig(
        model_name="tiny",
        architecture="LlamaForCausalLM",
        dtype="float32",
        max_model_len=256,
        vocab_size=tokenizer.vocab_size,
        block_size=8,
        policy=policy,
        disaggregation=disaggregation,
    )
    return Router(cfg, tokenizer, [prefill], decode), prefill, decode


def request(request_id: str, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(
        PROMPT,
        request_id=request_id,
        sampling=SamplingOptions(temperature=0.0),
        stopping=StoppingOptions(max_tokens=max_tokens),
    )


async def consume(router: Router, req: GenerateRequest) -> str:
    """Run the request to its end; its finish reason, or the error code."""
    try:
        async for event in router.generate(req):
            if event.finish is not None:
                return event.finish.reason
    except RouterError as exc:
        return exc.code.name
    return "no finish"


async def until(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def counted(router: Router) -> dict[str, set[str]]:
    """The requests each worker counts (routed here and not ended here)."""
    return {v.name: set(v.routed) for v in [*router.prefill, *router.decode]}


@pytest.mark.parametrize("policy", ["least_loaded", "kv_aware"])
@pytest.mark.parametrize("num_decode,num_requests", [(2, 6), (3, 8)])
def test_a_burst_lands_on_every_decode_worker(tokenizer, policy, num_decode, num_requests):
    router, prefill, _ = make_router(tokenizer, num_decode, policy)

    async def main():
        await router.start(ready_timeout_s=5)
        tasks = [
            asyncio.create_task(consume(router, request(f"r{i}"))) for i in range(num_requests)
        ]
        await until(lambda: len(prefill.items) == num_requests, "every prefill submit")
        # All still in prefill: no decode worker has any, yet each counts its share.
        per_worker = {v.name: len(v.routed) for v in router.decode}
        status = cluster_status(router)
        incoming = {w.name: w.num_incoming for w in status.pools[1].workers}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await router.stop()
        return per_worker, incoming

    per_worker, incoming = asyncio.run(main())
    assert max(per_worker.values()) - min(per_worker.values()) <= 1, per_worker
    assert sum(per_worker.values()) == num_requests
    assert incoming == per_worker


def test_ties_do_not_go_by_name_when_requests_come_one_at_a_time(tokenizer):
    """Each request finishes before the next: every worker is idle at each routing, and
    the tie spreads them instead of sending every one to decode-0."""
    router, _, decode = make_router(tokenizer, 2, "least_loaded", "never")

    async def main():
        await router.start(ready_timeout_s=5)
        for i in range(4):
            task = asyncio.create_task(consume(router, request(f"r{i}", max_tokens=1)))
            worker = await _holder(decode, f"r{i}")
            worker.send(TokenEvent(f"r{i}", (5,), True, "length"))
            assert await task == "length"
            await until(lambda: not router.num_in_flight, "settled")
        await router.stop()
        return Counter(w.name for w in decode for _ in w.items)

    assert asyncio.run(main()) == {"decode-0": 2, "decode-1": 2}


async def _holder(workers: list[ManualWorker], request_id: str) -> ManualWorker:
    await until(lambda: any(request_id in w.items for w in workers), f"{request_id} submitted")
    return next(w for w in workers if request_id in w.items)


# Each end path: (how the test ends request r on its workers, the outcome the client sees).
async def _finish(router, prefill, decode):
    prefill.send(TokenEvent("r", (5,), True, kv_handles=(b"kv",)))
    worker = await _holder(decode, "r")
    worker.send(TokenEvent("r", (6,), False))
    assert counted(router)[worker.name] == {"r"} and counted(router)["prefill-0"] == set()
    worker.send(TokenEvent("r", (7,), True, "length"))


async def _abort_in_prefill(router, prefill, decode):
    await router.abort("r")


async def _abort_in_decode(router, prefill, decode):
    prefill.send(TokenEvent("r", (5,), True, kv_handles=(b"kv",)))
    await _holder(decode, "r")
    await router.abort("r")


async def _failure_on_prefill(router, prefill, decode):
    prefill.send(TokenEvent("r", (), True, error="out of memory"))


async def _refused_decode_submit(router, prefill, decode):
    for worker in decode:
        worker.refuse = True
    prefill.send(TokenEvent("r", (5,), True, kv_handles=(b"kv",)))


async def _decode_worker_lost(router, prefill, decode):
    (worker,) = [w for w in decode if w.name in {v.name for v in router.decode if v.routed}]
    worker.on_lost("connection closed")
    prefill.send(TokenEvent("r", (5,), True, kv_handles=(b"kv",)))
    # The request migrates to the other decode worker (router/migration.py): counted there.
    (other,) = [w for w in decode if w is not worker]
    await until(lambda: "r" in other.items, "the migrated submit")
    assert counted(router)[other.name] == {"r"} and counted(router)[worker.name] == set()
    other.send(TokenEvent("r", (6,), True, "length"))


async def _decode_worker_restarted(router, prefill, decode):
    (view,) = [v for v in router.decode if v.routed]
    view.client.on_lost("connection closed")
    fresh = ManualWorker(view.name, "decode")
    await router.replace_worker(view.name, fresh)
    assert counted(router)[view.name] == set()
    await router.abort("r")


@pytest.mark.parametrize(
    "end,outcome",
    [
        (_finish, "length"),
        (_abort_in_prefill, "abort"),
        (_abort_in_decode, "abort"),
        (_failure_on_prefill, "INTERNAL"),
        (_refused_decode_submit, "UNAVAILABLE"),  # every decode worker, up to the limit
        (_decode_worker_lost, "length"),
        (_decode_worker_restarted, "abort"),
    ],
)
def test_the_expected_load_is_dropped_on_every_end_path(tokenizer, end, outcome):
    router, prefill, decode = make_router(tokenizer, 2, "kv_aware")

    async def main():
        await router.start(ready_timeout_s=5)
        task = asyncio.create_task(consume(router, request("r")))
        await until(lambda: "r" in prefill.items, "the prefill submit")
        during = counted(router)
        await end(router, prefill, decode)
        result = await task
        await until(lambda: not router.num_in_flight, "settled")
        after = counted(router)
        await router.stop()
        return during, result, after

    during, result, after = asyncio.run(main())
    assert during["prefill-0"] == {"r"}
    assert sorted(len(during[f"decode-{i}"]) for i in range(2)) == [0, 1]
    assert result == outcome
    assert after == {"prefill-0": set(), "decode-0": set(), "decode-1": set()}
