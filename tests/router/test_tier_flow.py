"""The KV tiers from a worker's engine to the router's choice, over real engines and the
real event channel (the in-process cluster of test_router_flow.py): a prompt whose
blocks one worker holds in a tier below its pool is routed there, and that worker's
status and metrics show the tier. The tier is a test double of the KVTier protocol set
as the engine's ``kv_tiers``; what a real tier holds is the engine's business
(tests/workers/kv_tiers/)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from router.config import RouterConfig
from router.router import Router
from router.status import cluster_status
from tests.router.test_router_flow import InProcessClient, collect, req
from tests.workers.test_tier_report import ListTier
from workers.engine.config import EngineConfig
from workers.engine.kv_tiers.flush import FlushStats
from workers.engine.llm_engine import LLMEngine
from workers.protocol.block_hashes import hash_prompt_blocks
from workers.serving.channel import ChannelListener
from workers.serving.metrics import WorkerMetrics
from workers.serving.service import EngineService
from workers.text.tokenizer import Tokenizer

BLOCK_SIZE = 8
PROMPT = "Once upon a time in a land far away there lived a curious engineer who " * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tier-flow") / "tiny", "llama", "tiny")


def test_a_prefix_in_a_workers_host_tier_draws_the_request_there(model_dir):
    listener = ChannelListener()
    tiers = {name: ListTier("host", 64, block_bytes=1024) for name in ("decode-0", "decode-1")}
    services = []
    for name, tier in tiers.items():
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir), max_model_len=256, block_size=BLOCK_SIZE,
                num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=128, detokenize=False,
            )
        )  # fmt: skip
        # The reporting side reads .tiers; stopping the service closes them; a step reads
        # .layerwise (no layer-wise onboarding here).
        engine.kv_tiers = SimpleNamespace(tiers=(tier,), close=lambda: FlushStats(), layerwise=None)
        metrics = WorkerMetrics("decode", "tiny", f"{name}-tierflow")
        services.append(EngineService(engine, name, "decode", metrics=metrics))
    tokenizer = Tokenizer.from_dir(model_dir)
    router = Router(
        RouterConfig(
            model_name="tiny", architecture="LlamaForCausalLM", dtype="float32",
            max_model_len=256, vocab_size=services[0].engine.vocab_size,
            block_size=BLOCK_SIZE, policy="kv_aware", disaggregation="never",
        ),
        tokenizer,
        [],
        [InProcessClient(s, listener) for s in services],
    )  # fmt: skip
    token_ids = tokenizer.encode(PROMPT)
    hashes = hash_prompt_blocks(token_ids, BLOCK_SIZE)
    assert len(hashes) >= 4

    async def main():
        await router.start(ready_timeout_s=30)
        try:
            # decode-1 offloaded this prompt's blocks earlier (its pool holds none).
            for block_hash in hashes:
                tiers["decode-1"].put(block_hash)
            view = router.decode[1]
            for _ in range(500):
                if set(hashes) <= set(dict(view.state().tier_hashes).get("host", ())):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("decode-1's tier events never reached the router")
            # With nothing cached anywhere the tie would go to decode-0 (cursor 0).
            _, _, final = await collect(router, req(PROMPT, max_tokens=2))
            assert final.timing.decode_worker == "decode-1"
            status = cluster_status(router)
            workers = {w.name: w for p in status.pools for w in p.workers}
            (tier,) = workers["decode-1"].kv_tiers
            assert (tier.name, tier.blocks, tier.capacity_blocks) == ("host", len(hashes), 64)
            assert workers["decode-0"].kv_tiers[0].blocks == 0
            labels = {"role": "decode", "model": "tiny", "instance": "decode-1-tierflow"}
            blocks = REGISTRY.get_sample_value("baton_kv_tier_blocks", {**labels, "tier": "host"})
            assert blocks == len(hashes)
        finally:
            await router.stop()
            for s in services:
                s.stop()
            for view in router.decode:
                if view.client.sender is not None:
                    view.client.sender.close()
            await listener.close()

    asyncio.run(main())
