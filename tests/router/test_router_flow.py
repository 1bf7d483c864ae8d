"""The router's request flow over real engines in one process (no Ray, no gRPC).

Each worker is a real :class:`~workers.serving.service.EngineService` (engine thread, KV
connector) on the in-process KV backend, pushing its events to the router over the real
event channel (loopback TCP); only the Ray control calls are replaced by direct calls. This is where the policies and the awkward moments of the hand-off (abort while
the KV is in flight, a lost transfer) are pinned down quickly; tests/e2e repeats the
main paths through Ray, NIXL and gRPC.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, create_connector
from kvtransfer.local_backend import LocalFabric
from proto.baton.v1 import inference_pb2 as pb
from router.config import RouterConfig
from router.errors import RouterError
from router.router import Router
from router.server import generate_request, generate_response
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.serving.channel import ChannelListener, ChannelReader, ChannelSender
from workers.serving.metrics import WorkerMetrics
from workers.serving.service import EngineService
from workers.text.tokenizer import Tokenizer

LONG_PREFIX = "Once upon a time in a land far away there lived a curious engineer who " * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("flow") / "tiny", "llama", "tiny")


class InProcessClient:
    """A WorkerClient that calls the service directly (stands in for the Ray actor)."""

    def __init__(self, service: EngineService, listener: ChannelListener):
        self.service = service
        self.name = service.name
        self.role = service.role
        self.listener = listener
        self.sender: ChannelSender | None = None
        self.channel: ChannelReader | None = None

    async def start(self):
        listener = self.listener
        await listener.start()
        future = listener.expect(self.name)
        self.sender = await asyncio.to_thread(
            ChannelSender, listener.host, listener.port, self.name, listener.token
        )
        self.service.attach(self.sender.send)
        self.channel = await listener.accepted(self.name, future)

    async def submit(self, item):
        self.service.submit(item)

    async def abort(self, request_id):
        self.service.abort(request_id)

    async def decline(self, handles):
        self.service.decline(handles)

    def listen(self, on_batch, on_lost):
        self.channel.listen(on_batch, on_lost)

    def close(self):
        if self.channel is not None:
            self.channel.close()


class Cluster:
    def __init__(
        self,
        model_dir,
        num_prefill=1,
        num_decode=1,
        hold_transfers=False,
        decode_settings=None,  # EngineConfig fields of the decode workers only
        tracing=None,  # router.tracing.Tracing
        transfer=None,  # KVTransferConfig fields
        fabric=None,  # a LocalFabric (a slow link: bandwidth, per_transfer_s)
        **router,
    ):
        self.fabric = fabric or LocalFabric(hold_transfers=hold_transfers)
        self.listener = ChannelListener()
        transfer = {"lease_seconds": 20, "transfer_timeout_s": 5, **(transfer or {})}
        config = KVTransferConfig(backend="local", **transfer)
        self.services: dict[str, EngineService] = {}
        for role, count in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(count):
                name = f"{role}-{i}"
                engine = LLMEngine(
                    EngineConfig(
                        model=str(model_dir),
                        max_model_len=256,
                        block_size=8,
                        num_kv_blocks=256,
                        max_num_seqs=16,
                        max_num_batched_tokens=128,
                        detokenize=False,
                        **((decode_settings or {}) if role == "decode" else {}),
                    )
                )

                def connector(eng, on_release, name=name):
                    layout = KVLayout.from_tensor(
                        eng.kv_cache, model_id="tiny", num_kv_heads=eng.arch.kv_cache_heads
                    )
                    return create_connector(
                        config, layout, eng.kv_cache, name, on_release, fabric=self.fabric
                    )

                # In-memory series, labelled apart from other tests' clusters.
                metrics = WorkerMetrics(role, "tiny", f"{name}-{id(self)}")
                self.services[name] = EngineService(engine, name, role, connector, metrics=metrics)
        metas = {n: s.connector.metadata() for n, s in self.services.items()}
        for s in self.services.values():
            for m, meta in metas.items():
                if s.role != self.services[m].role:
                    s.connector.add_peer(meta)
        engine = next(iter(self.services.values())).engine
        self.router = Router(
            RouterConfig(
                model_name="tiny",
                architecture="LlamaForCausalLM",
                dtype="float32",
                max_model_len=256,
                vocab_size=engine.vocab_size,
                block_size=8,
                **router,
            ),
            Tokenizer.from_dir(model_dir),
            [self._client(s) for s in self.services.values() if s.role == "prefill"],
            [self._client(s) for s in self.services.values() if s.role == "decode"],
            tracing=tracing,
        )

    def _client(self, service: EngineService) -> InProcessClient:
        return InProcessClient(service, self.listener)

    def used_blocks(self) -> dict[str, int]:
        return {n: s.engine.block_manager.num_used_blocks for n, s in self.services.items()}

    async def settled(self, timeout_s: float = 10.0) -> None:
        """Wait until no block is in use anywhere (requests ended, leases released)."""
        await self.settled_except((), timeout_s)

    async def settled_except(self, dead, timeout_s: float = 10.0) -> None:
        """The same, on every worker but the ``dead`` ones (their engines are gone)."""
        for _ in range(int(timeout_s / 0.02)):
            used = {n: b for n, b in self.used_blocks().items() if n not in dead}
            if not any(used.values()) and not self.router.num_in_flight:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"blocks still in use: {self.used_blocks()}")

    def close(self) -> None:
        for s in self.services.values():
            s.stop()
        for client in [*self.router.prefill, *self.router.decode]:
            if client.client.sender is not None:
                client.client.sender.close()


def run(cluster: Cluster, body):
    async def main():
        await cluster.router.start(ready_timeout_s=30)
        try:
            return await body(cluster.router)
        finally:
            await cluster.router.stop()
            cluster.close()
            await cluster.listener.close()

    return asyncio.run(main())


def req(
    prompt, max_tokens=16, disaggregation=pb.DISAGGREGATION_UNSPECIFIED, request_id="", **stopping
):
    r = pb.GenerateRequest(text=prompt, disaggregation=disaggregation, request_id=request_id)
    r.sampling.temperature = 0.0
    r.stopping.max_tokens = max_tokens
    r.stopping.ignore_eos = True
    for key, value in stopping.items():
        if key == "stop":
            r.stopping.stop.extend(value)
        else:
            setattr(r.stopping, key, value)
    r.output.return_timing = True
    return r


async def collect(router: Router, request: pb.GenerateRequest):
    """Run ``request`` through the router, converted both ways as the gRPC servicer does."""
    tokens, text, final = [], [], None
    async for event in router.generate(generate_request(request)):
        msg = generate_response(event)
        body = msg.delta if msg.HasField("delta") else msg.final.delta
        tokens.extend(body.token_ids)
        text.append(body.text)
        if msg.HasField("final"):
            final = msg.final
    return tokens, "".join(text), final


def test_disaggregated_equals_llm_generate_with_stop_strings_at_the_edge(model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    ref = llm.generate([LONG_PREFIX], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    text = ref[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # cuts the output mid-way
    ref_stop = llm.generate(
        [LONG_PREFIX], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    cluster = Cluster(model_dir, disaggregation="always")

    async def body(router):
        full = await collect(router, req(LONG_PREFIX))
        cut = await collect(router, req(LONG_PREFIX, stop=[stop]))
        await cluster.settled()
        return full, cut

    full, cut = run(cluster, body)
    assert full[0] == list(ref[0].token_ids) and full[1] == text
    assert full[2].timing.prefill_worker == "prefill-0"
    assert cut[0] == list(ref_stop.token_ids) and cut[1] == ref_stop.text
    assert cut[2].finish_reason == pb.FINISH_REASON_STOP and cut[2].stop_string == stop


def test_kv_aware_sends_a_shared_prefix_to_the_worker_that_holds_it(model_dir):
    cluster = Cluster(model_dir, num_prefill=0, num_decode=2, disaggregation="never")

    async def body(router):
        first = await collect(router, req(LONG_PREFIX + "first"))
        holder = first[2].timing.decode_worker
        view = next(v for v in router.decode if v.name == holder)
        while len(view.hashes) < 2:  # the holder's report (with its hashes) reaches the router
            await asyncio.sleep(0.01)
        # Exact ties go round robin: a short unrelated request to the other worker, so that
        # the next one loads the holder (least_loaded would then avoid it).
        await collect(router, req("filler " * 5, max_tokens=1, request_id="filler"))
        busy = asyncio.ensure_future(
            collect(router, req("unrelated " * 5, max_tokens=230, request_id="busy"))
        )
        while not any(v.active for v in router.decode):
            await asyncio.sleep(0.001)
        busy_worker = next(v.name for v in router.decode if v.active)
        second = await collect(router, req(LONG_PREFIX + "second", max_tokens=2))
        was_busy = "busy" in view.active
        await router.abort("busy")
        await busy
        await cluster.settled()
        return holder, busy_worker, second, was_busy

    holder, busy_worker, second, was_busy = run(cluster, body)
    # The holder was the more loaded worker when the second request came; its cached
    # prefix (11 blocks) outweighs the busy request's few blocks in use.
    assert was_busy and busy_worker == holder
    assert second[2].timing.decode_worker == holder
    assert second[2].usage.cached_prompt_tokens >= 16


def test_abort_while_the_kv_is_in_flight_frees_both_sides(model_dir):
    cluster = Cluster(model_dir, hold_transfers=True, disaggregation="always")

    async def body(router):
        task = asyncio.ensure_future(collect(router, req(LONG_PREFIX, request_id="r1")))
        decode = router.decode[0]
        while "r1" not in decode.active:  # handed to decode: the transfer is held
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert cluster.used_blocks()["prefill-0"] > 0 and cluster.used_blocks()["decode-0"] > 0
        assert await router.abort("r1")
        tokens, _, final = await task
        await asyncio.sleep(0.2)
        cluster.fabric.complete_held()  # a transfer that is no longer wanted does not run
        await cluster.settled()
        return tokens, final

    tokens, final = run(cluster, body)
    assert final.finish_reason == pb.FINISH_REASON_ABORT
    assert len(tokens) == 1  # the first token, from the prefill worker


def test_lost_prefill_worker_recomputes_on_decode(model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    ref = llm.generate([LONG_PREFIX], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    cluster = Cluster(model_dir, hold_transfers=True, disaggregation="always")

    async def body(router):
        task = asyncio.ensure_future(collect(router, req(LONG_PREFIX, request_id="r2")))
        while "r2" not in router.decode[0].active:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        prefill = cluster.services["prefill-0"]
        cluster.fabric.kill(prefill.connector.agent_name)
        cluster.fabric.complete_held()
        return await task

    tokens, _, final = run(cluster, body)
    assert tokens == list(ref[0].token_ids)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    failures = "baton_kv_transfer_failures_total"
    labels = {"role": "decode", "model": "tiny", "instance": f"decode-0-{id(cluster)}"}
    assert REGISTRY.get_sample_value(failures, {**labels, "stage": "receive"}) == 1
    assert REGISTRY.get_sample_value("baton_kv_transfer_seconds_count", labels) == 0


def test_refusals(model_dir):
    cluster = Cluster(model_dir, disaggregation="always", max_queued_requests=1)

    async def body(router):
        codes = []
        bad = req("hi")
        bad.sampling.top_p = 7.0
        slow = asyncio.ensure_future(
            collect(router, req(LONG_PREFIX, max_tokens=180, request_id="slow"))
        )
        await asyncio.sleep(0.05)
        for request in (bad, req("hi")):
            try:
                await collect(router, request)
            except RouterError as exc:
                codes.append((exc.code, exc.message.split(":")[0]))
        assert await router.abort("slow")
        await slow
        await cluster.settled()
        router.is_draining = True
        try:
            await collect(router, req("hi"))
        except RouterError as exc:
            codes.append((exc.code, ""))
        return codes

    codes = run(cluster, body)
    # A bad request is judged before admission; a good one past the limit is refused.
    assert codes == [
        ("INVALID_ARGUMENT", "sampling.top_p"),
        ("RESOURCE_EXHAUSTED", "1 requests in flight (router.max_queued_requests=1); retry later"),
        ("UNAVAILABLE", ""),
    ]


def test_stop_token_id_ends_with_the_same_text_as_llm_generate(model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    stop_id = llm.generate([LONG_PREFIX], plain)[0].token_ids[6]
    stopped = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]
    )
    ref = llm.generate([LONG_PREFIX], stopped)[0]
    cluster = Cluster(model_dir, disaggregation="always")

    async def body(router):
        request = req(LONG_PREFIX)
        request.stopping.stop_token_ids.append(stop_id)
        return await collect(router, request)

    tokens, text, final = run(cluster, body)
    assert tokens == list(ref.token_ids) and text == ref.text
    assert final.finish_reason == pb.FINISH_REASON_STOP and final.stop_token_id == stop_id


def test_a_crashed_engine_fails_its_requests_instead_of_hanging(model_dir):
    cluster = Cluster(model_dir, disaggregation="never")
    engine = cluster.services["decode-0"].engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = failing_step

    async def body(router):
        with pytest.raises(RouterError) as info:
            await asyncio.wait_for(collect(router, req(LONG_PREFIX, max_tokens=50)), 10)
        # No other decode worker to migrate to (tests/router/test_migration.py).
        assert info.value.code == "UNAVAILABLE" and "device lost" in info.value.message
        assert "worker decode-0 failed" in info.value.message
        with pytest.raises(RouterError) as again:
            await collect(router, req("next"))
        return again.value.code, router.decode[0].is_alive

    assert run(cluster, body) == ("UNAVAILABLE", False)
