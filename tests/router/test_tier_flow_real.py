"""The engine's real host tier (kv_cache.host_tier_gib) through the real event channel:
the router's view of each worker's host tier is exactly what the tier holds, a prompt
the pool evicted but the host tier kept draws its next turn to that worker (against the
round-robin tie-break), where it is onboarded, and the status and metrics show it."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from router.status import cluster_status
from tests.router.test_router_flow import Cluster, collect, req, run
from workers.protocol.block_hashes import hash_prompt_blocks

NUM_PROMPTS = 30  # ~22 blocks each, alternating: each pool (256 blocks) evicts its first


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tier-real") / "tiny", "llama", "tiny")


def prompt(i: int) -> str:
    return f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(25))


async def views_agree(router, engines) -> bool:
    for _ in range(200):
        views = {v.name: v for v in router.decode}
        if all(
            set(dict(views[n].state().tier_hashes).get("host", ()))
            == set(e.kv_tiers.tiers[0].hashes())
            for n, e in engines.items()
        ):
            return True
        await asyncio.sleep(0.05)
    return False


def test_host_tier_events_reach_the_router_and_draw_the_next_turn(model_dir):
    cluster = Cluster(
        model_dir, num_prefill=0, num_decode=2, decode_settings={"kv_host_tier_gib": 0.01},
        policy="kv_aware", disaggregation="never",
    )  # fmt: skip
    engines = {n: s.engine for n, s in cluster.services.items()}

    def held_below_pool_only(i: int) -> list[str]:
        first = hash_prompt_blocks(cluster.router.tokenizer.encode(prompt(i)), 8)[0]
        return [
            n for n, e in engines.items()
            if first in e.kv_tiers.tiers[0].hashes()
            and first not in set(e.block_manager.cached_block_hashes())
        ]  # fmt: skip

    async def body(router):
        for i in range(NUM_PROMPTS):
            await collect(router, req(prompt(i), max_tokens=1))
        assert await views_agree(router, engines)
        assert all(e.kv_tiers.tiers[0].hashes() for e in engines.values())
        # The next request's tie would go to decode-0 (cursor NUM_PROMPTS, even): take a
        # prompt only decode-1's host tier holds.
        i = next(i for i in range(NUM_PROMPTS) if held_below_pool_only(i) == ["decode-1"])
        _, _, final = await collect(router, req(prompt(i), max_tokens=1))
        assert final.timing.decode_worker == "decode-1"
        assert final.usage.cached_prompt_tokens >= 8  # onboarded, not computed
        assert await views_agree(router, engines)
        await asyncio.sleep(0.3)  # a report with the tier's new stats
        workers = {w.name: w for p in cluster_status(router).pools for w in p.workers}
        (host,) = workers["decode-1"].kv_tiers
        assert host.hits >= final.usage.cached_prompt_tokens // 8
        labels = {"role": "decode", "model": "tiny", "tier": "host"}
        labels["instance"] = f"decode-1-{id(cluster)}"
        assert REGISTRY.get_sample_value("baton_kv_tier_hits_total", labels) == host.hits
        assert REGISTRY.get_sample_value("baton_kv_tier_blocks", labels) == host.blocks

    run(cluster, body)
