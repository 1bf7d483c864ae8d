"""The planner's feed on a real in-process cluster (tests/router/test_router_flow.py's engines,
1 prefill + 1 decode worker): the router's three observer calls give the window its
arrivals and lengths, step records of both pools, and measured TTFT and ITL."""

from __future__ import annotations

import asyncio

from cluster.planner.step_model import DecodeStep, PrefillStep
from cluster.planner_feed import LoadFeed
from tests.router.test_router_flow import LONG_PREFIX, Cluster, collect, model_dir, req, run

__all__ = ["model_dir"]  # the module-scoped fixture, reused


def test_the_feed_sees_arrivals_steps_and_latencies_of_a_real_flow(model_dir):
    cluster = Cluster(model_dir, disaggregation="always")
    feed = LoadFeed(window_s=60.0)
    cluster.router.observer = feed

    async def body(router):
        prompts = [f"{LONG_PREFIX} number {i}" for i in range(4)]
        outs = await asyncio.gather(*(collect(router, req(p, max_tokens=12)) for p in prompts))
        await cluster.settled()
        return outs, feed.take(feed.clock())

    outs, window = run(cluster, body)
    assert all(len(tokens) == 12 for tokens, _, _ in outs)
    assert len(window.requests) == 4
    assert all(r.output_tokens == 12 and r.prompt_tokens >= 1 for r in window.requests)
    prefill = [s for s in window.steps if isinstance(s, PrefillStep)]
    decode = [s for s in window.steps if isinstance(s, DecodeStep)]
    assert prefill and {s.worker_id for s in prefill} == {"prefill-0#0"}
    assert decode and {s.worker_id for s in decode} == {"decode-0#0"}
    assert sum(s.tokens for s in prefill) == sum(r.prompt_tokens for r in window.requests)
    assert all(s.seconds > 0 for s in window.steps)
    assert all(1 <= s.batch <= 4 for s in decode)
    # every token after a request's first was one decode step's output: 11 per request
    assert sum(s.batch for s in decode) == 4 * 11
    assert len(window.ttft_s) == 4 and len(window.itl_s) == 4 * 11
    assert all(t > 0 for t in window.ttft_s)
