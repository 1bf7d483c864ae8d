"""Live scaling (router/scaling.py) over real engines in one process.

The in-process cluster of test_router_flow, with an in-process provisioner: a new worker
is a real EngineService, introduced to the other pool's KV connectors both ways; a
removed one is stopped. What must hold: a new decode worker gets no request before its
first report, then takes its share, handed off from the prefill worker, with the
single-process engine's tokens; a draining worker gets no new request while its running
ones finish with their tokens, then it is stopped with no block in use; past the grace
its requests migrate and still give the reference tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, create_connector
from router.scaling import Scaling
from tests.router.test_router_flow import Cluster, InProcessClient, collect, req, run
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.serving.metrics import WorkerMetrics
from workers.serving.service import EngineService

PROMPT = "The lighthouse keeper wrote a letter every evening about the sea and "
STEP_DELAY_S = 0.01  # per decode step: a long stream outlasts the grace


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("scale") / "tiny", "llama", "tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", max_model_len=256)


def reference(llm, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(llm.generate([PROMPT], params)[0].token_ids)


def make_service(cluster: Cluster, model_dir, name: str, role: str) -> EngineService:
    """A worker as test_router_flow's Cluster makes them, on its fabric."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            max_model_len=256,
            block_size=8,
            num_kv_blocks=256,
            max_num_seqs=16,
            max_num_batched_tokens=128,
            detokenize=False,
        )
    )
    config = KVTransferConfig(backend="local", lease_seconds=20, transfer_timeout_s=5)

    def connector(eng, on_release):
        layout = KVLayout.from_tensor(
            eng.kv_cache, model_id="tiny", num_kv_heads=eng.arch.num_key_value_heads
        )
        return create_connector(
            config, layout, eng.kv_cache, name, on_release, fabric=cluster.fabric
        )

    metrics = WorkerMetrics(role, "tiny", f"{name}-{id(cluster)}")
    return EngineService(engine, name, role, connector, metrics=metrics)


class GatedClient(InProcessClient):
    """Its batches (the first report included) reach the router only once ``gate`` is set."""

    def __init__(self, service, listener, gate: asyncio.Event):
        super().__init__(service, listener)
        self.gate = gate

    def listen(self, on_batch, on_lost):
        def gated(batch):
            if self.gate.is_set():
                on_batch(batch)

        super().listen(gated, on_lost)


class InProcessProvisioner:
    """New workers are EngineServices in this process; removed ones are stopped."""

    def __init__(self, cluster: Cluster, model_dir, gate: asyncio.Event | None = None):
        self.cluster = cluster
        self.model_dir = model_dir
        self.gate = gate
        self.index = Counter(s.role for s in cluster.services.values())
        self.retired: dict[str, EngineService] = {}
        self.used_at_removal: dict[str, int] = {}

    async def check_room(self, num_prefill: int, num_decode: int) -> None:
        pass

    async def add(self, role: str) -> InProcessClient:
        name = f"{role}-{self.index[role]}"
        self.index[role] += 1
        service = await asyncio.to_thread(make_service, self.cluster, self.model_dir, name, role)
        for other in self.cluster.services.values():  # both ways, as bring-up does
            if other.role != role:
                other.connector.add_peer(service.connector.metadata())
                service.connector.add_peer(other.connector.metadata())
        slow_down(service)
        self.cluster.services[name] = service
        if self.gate is None:
            return InProcessClient(service, self.cluster.listener)
        return GatedClient(service, self.cluster.listener, self.gate)

    async def remove(self, name: str) -> None:
        service = self.cluster.services.pop(name)
        self.used_at_removal[name] = service.engine.block_manager.num_used_blocks
        await asyncio.to_thread(service.stop)
        self.retired[name] = service


def slow_down(service: EngineService) -> None:
    if service.role != "decode":
        return
    engine, real_step = service.engine, service.engine.step

    def step():
        time.sleep(STEP_DELAY_S)
        return real_step()

    engine.step = step


def scaled_cluster(model_dir, num_prefill, num_decode, grace_s, gate=None, **router):
    cluster = Cluster(model_dir, num_prefill, num_decode, policy="round_robin", **router)
    for service in cluster.services.values():
        slow_down(service)
    provisioner = InProcessProvisioner(cluster, model_dir, gate)
    cluster.router.scaling = Scaling(cluster.router, provisioner, grace_s)
    return cluster, provisioner


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def test_an_added_decode_worker_is_routed_to_after_its_first_report(model_dir, llm):
    ref = reference(llm, 8)
    gate = asyncio.Event()
    cluster, _ = scaled_cluster(model_dir, 1, 1, 30.0, gate, disaggregation="always")

    async def body(router):
        scale = asyncio.ensure_future(router.scaling.scale_to(1, 2))
        await until(lambda: len(router.decode) == 2)  # joining: its channel is open
        joining = [await collect(router, req(PROMPT, 8)) for _ in range(3)]
        gate.set()  # its reports flow: the first makes it routable
        result = await scale
        after = [await collect(router, req(PROMPT, 8)) for _ in range(4)]
        await cluster.settled()
        return result, joining, after

    result, joining, after = run(cluster, body)
    assert result.added == ("decode-1",) and result.after == (1, 2)
    assert {final.timing.decode_worker for _, _, final in joining} == {"decode-0"}
    # Round robin over both; decode-1's KV came from prefill-0 (introduced both ways).
    assert {final.timing.decode_worker for _, _, final in after} == {"decode-0", "decode-1"}
    assert all(final.timing.prefill_worker == "prefill-0" for _, _, final in after)
    assert all(tokens == ref for tokens, _, _ in [*joining, *after])


def test_a_draining_worker_takes_nothing_new_finishes_its_streams_and_stops(model_dir, llm):
    ref_long, ref_short = reference(llm, 120), reference(llm, 4)
    cluster, provisioner = scaled_cluster(model_dir, 1, 2, 30.0, disaggregation="always")

    async def body(router):
        streams = [
            asyncio.ensure_future(collect(router, req(PROMPT, 120, request_id=f"long-{i}")))
            for i in range(2)
        ]
        await until(lambda: all(v.active for v in router.decode))
        scale = asyncio.ensure_future(router.scaling.scale_to(1, 1))
        await until(lambda: any(v.is_draining for v in router.decode))
        victim = next(v for v in router.decode if v.is_draining)
        during = [await collect(router, req(PROMPT, 4)) for _ in range(3)]
        was_serving = bool(victim.active) and victim in router.decode
        long = await asyncio.gather(*streams)
        result = await scale
        await cluster.settled()
        return victim.name, was_serving, during, long, result

    victim, was_serving, during, long, result = run(cluster, body)
    assert was_serving  # its stream still ran while the others were routed elsewhere
    assert all(final.timing.decode_worker != victim for _, _, final in during)
    assert all(tokens == ref_short for tokens, _, _ in during)
    assert [tokens for tokens, _, _ in long] == [ref_long, ref_long]
    assert result.retired == (victim,) and result.num_migrated == 0
    assert result.after == (1, 1)
    assert provisioner.used_at_removal == {victim: 0}
    assert provisioner.retired[victim].engine.block_manager.num_used_blocks == 0


def test_past_the_grace_a_draining_worker_s_streams_migrate_with_their_tokens(model_dir, llm):
    ref = reference(llm, 160)
    cluster, provisioner = scaled_cluster(model_dir, 1, 2, 0.2, disaggregation="never")

    async def body(router):
        streams = [
            asyncio.ensure_future(collect(router, req(PROMPT, 160, request_id=f"long-{i}")))
            for i in range(2)
        ]
        await until(lambda: all(v.active for v in router.decode))
        result = await router.scaling.scale_to(1, 1)
        long = await asyncio.gather(*streams)
        await cluster.settled()
        return result, long

    result, long = run(cluster, body)
    (victim,) = result.retired
    assert result.num_migrated == 1
    assert [tokens for tokens, _, _ in long] == [ref, ref]
    survivor = ({"decode-0", "decode-1"} - {victim}).pop()
    assert {final.timing.decode_worker for _, _, final in long} == {survivor}
    assert provisioner.retired[victim].engine.block_manager.num_used_blocks == 0
