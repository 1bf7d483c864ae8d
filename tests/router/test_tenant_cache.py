"""Across the router, over real engines: a tenant's (or a salt's) prompt is never served
from another's cached KV, and ``cached_prompt_tokens`` tells nothing of another's prompts;
a tenant still hits its own cache, and a prefill -> decode hand-off keeps the salt."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.server import generate_request
from tests.router.test_router_flow import LONG_PREFIX, Cluster, model_dir, req, run

__all__ = ["model_dir"]


async def cached(router, tenant: str = "", salt: str = "") -> int:
    request = replace(
        generate_request(req(LONG_PREFIX, max_tokens=4)), tenant=tenant, cache_salt=salt
    )
    async for event in router.generate(request):
        last = event
    return last.finish.usage.cached_prompt_tokens


@pytest.mark.parametrize("disaggregation", ["never", "always"])
def test_no_cross_tenant_prefix_hit(model_dir, disaggregation):
    num_prefill = 1 if disaggregation == "always" else 0
    cluster = Cluster(model_dir, num_prefill, 1, disaggregation=disaggregation)

    async def body(router):
        seen = {}
        seen["a"] = await cached(router, "tenant-a")
        seen["a again"] = await cached(router, "tenant-a")
        seen["b"] = await cached(router, "tenant-b")
        seen["a, another salt"] = await cached(router, "tenant-a", "mine")
        seen["shared"] = await cached(router)
        seen["shared again"] = await cached(router)
        await cluster.settled()
        return seen

    seen = run(cluster, body)
    assert seen["a"] == 0 and seen["a again"] >= 64  # its own cache: hit
    assert seen["b"] == 0  # another tenant's: nothing
    assert seen["a, another salt"] == 0
    assert seen["shared"] == 0 and seen["shared again"] >= 64
