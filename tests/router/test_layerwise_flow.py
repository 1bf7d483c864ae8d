"""The layer-wise KV hand-off through the router, over real engines in one process.

The decode worker reserves first, the prefill worker streams the KV into its blocks
while it computes, the decode worker decodes once every layer landed (router/layerwise.py,
workers/serving/stream_transport.py). What must hold: a long prompt goes layer-wise and
gives exactly the whole-request path's tokens; a short one keeps the whole-request path;
a stream failing after some groups is recomputed with the same tokens; the first token
ending the request and an abort leave nothing behind; ``kv_transfer.layerwise: off``
keeps today's path; no block is left in use anywhere.

The prefill worker's numbers are seeded (a slow link, so that the chooser streams long
prompts), and its own measurements are switched off, so that the choice is the test's.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.tools.make_model import make_model
from kvtransfer.local_backend import LocalFabric
from router.router import Router
from router.server import generate_request
from tests.router.test_migration import crash_after
from tests.router.test_router_flow import LONG_PREFIX, Cluster, collect, req, run
from workers.serving.layerwise_stats import LayerwiseStats

SHORT = "Hello there"
BANDWIDTH = 4e6  # bytes/s of the slow link (the tiny model's KV: ~1 kB per token)
LONG = LONG_PREFIX * 2
# Another long prompt sharing no block with LONG: the prefill worker's prefix cache (which
# the router learns of through KV events, as soon as they come) does not shorten it.
LONG_B = "Far beyond the northern hills, " + LONG


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("layerwise-flow") / "tiny", "llama", "tiny")


def layerwise_cluster(model_dir, num_prefill=1, num_decode=1, **transfer) -> Cluster:
    transfer = {"layerwise": "auto", "transfer_timeout_s": 15, **transfer}
    cluster = Cluster(
        model_dir, num_prefill, num_decode, disaggregation="always", transfer=transfer
    )
    for service in cluster.services.values():
        stats = service.stream.stats
        if service.role != "prefill":
            assert stats is None
            continue
        assert isinstance(stats, LayerwiseStats)
        service.engine.step_times.listeners.clear()  # the test's numbers, not the machine's
        stats.layer_s_per_token = 2e-4
        stats.observe_link(10_000, 0.002)
        stats.observe_link(1_000_000, 0.101)  # 10 MB/s, 1 ms per transfer
        stats.observe_link = lambda *_: None  # type: ignore[method-assign]
    return cluster


def num_tokens(router: Router, text: str) -> int:
    return len(router.tokenizer.encode(text))


async def threshold(router: Router) -> int:
    for _ in range(100):
        report = router.prefill[0].report
        if report is not None and report.layerwise_min_tokens:
            return report.layerwise_min_tokens
        await asyncio.sleep(0.05)
    raise AssertionError("the prefill worker reported no layer-wise threshold")


def assert_clean(cluster: Cluster) -> None:
    for service in cluster.services.values():
        engine = service.engine
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
        assert not engine.scheduler.requests and engine.num_held == 0
        assert engine.num_receiving == 0 and not service.stream.outs
        assert not service.stream.incoming
        assert service.connector.stats().num_streams == 0


def whole_request_tokens(model_dir, prompts, **kwargs):
    cluster = Cluster(model_dir, disaggregation="always", transfer={"layerwise": "off"})

    async def body(router):
        out = [(await collect(router, req(p, **kwargs)))[0] for p in prompts]
        await cluster.settled()
        assert router.prefill[0].report.layerwise_min_tokens == 0
        assert_clean(cluster)
        return out

    out = run(cluster, body)
    assert cluster.services["prefill-0"].stream.num_opened == 0  # switch off: today's path
    assert cluster.services["prefill-0"].stream.stats is None
    return out


def test_long_prompt_streams_layerwise_with_the_whole_request_tokens(model_dir):
    want = whole_request_tokens(model_dir, [LONG, SHORT, LONG_B])
    cluster = layerwise_cluster(model_dir)
    prefill, decode = cluster.services["prefill-0"], cluster.services["decode-0"]

    async def body(router):
        limit = await threshold(router)
        assert num_tokens(router, SHORT) < limit <= num_tokens(router, LONG)
        long_out = await collect(router, req(LONG))
        assert prefill.stream.num_opened == 1 and decode.stream.num_reserved == 1
        short_out = await collect(router, req(SHORT))
        assert prefill.stream.num_opened == 1  # the short one: whole request
        # The first token ends it: the prefill finishes it, its blocks wait for the
        # stream; the decode worker's reservation is aborted.
        one = await collect(router, req(LONG_B, max_tokens=1))
        assert prefill.stream.num_opened == 2
        await cluster.settled()
        assert_clean(cluster)
        return long_out, short_out, one

    long_out, short_out, one = run(cluster, body)
    assert long_out[0] == want[0] and short_out[0] == want[1]
    assert long_out[2].timing.prefill_worker == "prefill-0"
    assert one[0] == want[2][:1]


def test_a_stream_failing_after_some_groups_is_recomputed(model_dir, monkeypatch):
    want = whole_request_tokens(model_dir, [LONG, LONG_B])
    # Every 3rd transfer fails at post: the stream's first writes land, a later fails.
    monkeypatch.setenv("BATON_KV_FAULTS", "fail_every=3")
    cluster = layerwise_cluster(model_dir, allow_fault_injection=True)
    decode = cluster.services["decode-0"]

    async def body(router):
        await threshold(router)
        out = [await collect(router, req(p)) for p in (LONG, LONG_B)]
        await cluster.settled()
        assert_clean(cluster)
        return out

    outs = run(cluster, body)
    assert cluster.services["prefill-0"].stream.num_opened == 2
    assert [o[0] for o in outs] == want
    failed = decode.metrics._receive_failures._value.get()
    assert failed >= 1  # recomputed on the decode worker


@pytest.mark.parametrize("hold", [False, True])
def test_abort_after_the_first_token_leaves_nothing(model_dir, hold):
    cluster = layerwise_cluster(model_dir)
    decode = cluster.services["decode-0"]

    async def body(router):
        await threshold(router)
        cluster.fabric.hold_transfers = hold  # True: no write lands, the stream hangs
        gen = router.generate(generate_request(req(LONG, max_tokens=64)))
        async for _event in gen:
            break  # the first token came: close the stream
        if hold:
            assert decode.engine.num_receiving == 1  # still waiting for its layers
        await gen.aclose()
        await cluster.settled()
        assert_clean(cluster)

    run(cluster, body)


def test_auto_measures_compute_and_link_from_whole_request_hand_offs(model_dir):
    """Nothing seeded: the prefill worker's steps give it the compute per token and
    layer, its leases over a slow link the link (an upper bound: the router hop is in
    the fixed cost); what it reports is what the chooser says of those numbers, whichever way
    it decides. The link is slow (~15 ms for the biggest warm-up) so that the size-bound
    part outweighs the scheduling noise of a loaded machine."""
    fabric = LocalFabric(bandwidth=BANDWIDTH, per_transfer_s=0.002)
    transfer = {"layerwise": "auto", "transfer_timeout_s": 15}
    cluster = Cluster(model_dir, disaggregation="always", transfer=transfer, fabric=fabric)
    prefill = cluster.services["prefill-0"]
    stats = prefill.stream.stats

    async def body(router):
        for i in range(6):  # transfers of several sizes (and prefill steps)
            await collect(router, req(f"Warm-up {i}: " + "lorem ipsum dolor " * (1 + 3 * i), 2))
        await cluster.settled()
        assert stats.layer_s_per_token is not None and stats.layer_s_per_token > 0
        bandwidth, per_transfer = stats.link()
        # The fit is an estimate under whatever else the machine runs: the right order.
        assert BANDWIDTH / 3 < bandwidth < BANDWIDTH * 2
        assert per_transfer >= 0.002 * 0.8
        await asyncio.sleep(2.1)  # the threshold is recomputed every 2 s at most
        await asyncio.sleep(0.3)  # a report after it
        limit = stats.min_tokens()
        assert router.prefill[0].report.layerwise_min_tokens == limit
        if limit:
            assert stats.plan(limit).group_size is not None
        assert prefill.stream.num_opened == 0 or limit
        assert_clean(cluster)

    run(cluster, body)


def test_a_stream_the_prefill_cannot_open_is_recomputed_at_the_deadline(model_dir):
    want = whole_request_tokens(model_dir, [LONG])
    cluster = layerwise_cluster(model_dir, transfer_timeout_s=1.5)
    prefill, decode = cluster.services["prefill-0"], cluster.services["decode-0"]
    # The prefill worker forgets the decode worker: it cannot write its reservation.
    prefill.connector.remove_peer(decode.connector.agent_name)

    async def body(router):
        await threshold(router)
        out = await collect(router, req(LONG))
        await cluster.settled()
        assert_clean(cluster)
        return out

    out = run(cluster, body)
    assert out[0] == want[0]
    assert prefill.stream.num_opened == 0 and decode.stream.num_reserved == 1
    assert decode.metrics._receive_failures._value.get() >= 1  # recomputed there


def test_a_prefill_worker_dying_mid_stream_migrates_with_the_same_tokens(model_dir):
    want = whole_request_tokens(model_dir, [LONG])
    cluster = layerwise_cluster(model_dir, num_prefill=2)
    crashed = crash_after(cluster, "prefill", 0)  # its first step: the prompt's prefill

    async def body(router):
        await threshold(router)
        for view in router.prefill:  # both report a threshold before the request
            while not (view.report and view.report.layerwise_min_tokens):
                await asyncio.sleep(0.05)
        out = await collect(router, req(LONG))
        await cluster.settled_except(crashed)
        for name, service in cluster.services.items():
            if name not in crashed:
                service.engine.block_manager.check_integrity()
                assert service.engine.block_manager.num_used_blocks == 0
                assert not service.stream.incoming and not service.stream.outs
        return out

    out = run(cluster, body)
    assert len(crashed) == 1 and out[2].timing.prefill_worker != crashed[0]
    assert out[0] == want[0]


def test_the_mla_latent_cache_streams_with_the_whole_request_tokens(tmp_path_factory):
    """DeepSeek's latent cache (one entry per token and layer, docs/mla.md) streamed one
    layer per write (``layerwise: on``: no number asked) gives the whole-request tokens."""
    mla_dir = make_model(tmp_path_factory.mktemp("layerwise-mla") / "tiny", "deepseek-v3", "tiny")
    want = whole_request_tokens(mla_dir, [LONG, SHORT])
    transfer = {"layerwise": "on", "layerwise_min_tokens": 32, "transfer_timeout_s": 15}
    cluster = Cluster(mla_dir, disaggregation="always", transfer=transfer)
    prefill, decode = cluster.services["prefill-0"], cluster.services["decode-0"]
    assert prefill.connector.layout.num_kv_entries == 1  # the latent row
    assert prefill.stream.stats.group_size(num_tokens=200) == 1

    async def body(router):
        assert await threshold(router) == 32
        assert num_tokens(router, SHORT) < 32 <= num_tokens(router, LONG)
        out = [await collect(router, req(p)) for p in (LONG, SHORT)]
        await cluster.settled()
        assert_clean(cluster)
        return out

    outs = run(cluster, body)
    assert [o[0] for o in outs] == want
    assert prefill.stream.num_opened == 1 and decode.stream.num_reserved == 1  # LONG only
    assert prefill.metrics._streams["done"]._value.get() == 1
    assert prefill.metrics._streams["failed"]._value.get() == 0
