"""Peer pull (G4) through the router, over real engines in one process.

Two decode workers that prefill themselves (``disaggregation: never``), introduced to each
other as ``kv_cache.peer_sharing`` does, round robin so that a prompt whose prefix worker
A computed lands on worker B: B pulls A's blocks over the (in-process) KV transport
instead of recomputing them, and the tokens are those of ``LLM.generate``. When the
export is too slow or the transfer fails, B recomputes, with the same tokens. Another
tenant's (or salt's) prompt is never pulled from a peer. No block
stays in use anywhere, A's lease included. Each outcome moves its Prometheus series: the
router's ``baton_router_peer_exports_total{result}`` and B's ``baton_kv_peer_pulls_total``
and ``baton_kv_receive_blocks_total{source="peer"}``. ``choose_source`` is pinned down on
its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from router.peer_prefix import PeerExports, PeerSource, choose_source
from router.policy import WorkerState
from router.server import generate_request
from workers import LLM, SamplingParams

from .test_router_flow import LONG_PREFIX, Cluster, collect, req, run

BS = 8
PROMPT = LONG_PREFIX + "and then"  # LONG_PREFIX's blocks, then a few more tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("peer") / "tiny", "llama", "tiny")


def peer_cluster(model_dir, **settings) -> Cluster:
    settings = {"peer_min_blocks": 2, **settings}
    cluster = Cluster(
        model_dir,
        num_prefill=0,
        num_decode=2,
        policy="round_robin",
        disaggregation="never",
        peer_sharing=True,
        **settings,
    )
    a, b = cluster.services["decode-0"], cluster.services["decode-1"]
    a.connector.add_peer(b.connector.metadata())
    b.connector.add_peer(a.connector.metadata())
    return cluster


async def warm_then_ask(cluster: Cluster, router, min_hashes: int):
    """LONG_PREFIX on decode-0 (round robin's first), then PROMPT on decode-1."""
    first = await collect(router, req(LONG_PREFIX, max_tokens=1, request_id="warm"))
    assert first[2].timing.decode_worker == "decode-0"
    holder = router.decode[0]
    while len(holder.hashes) < min_hashes:  # its report with its hashes reaches the router
        await asyncio.sleep(0.01)
    second = await collect(router, req(PROMPT, request_id="second"))
    await cluster.settled()
    return second


class Series:
    """The peer-pull series of the router and of B (decode-1), read before and after."""

    def __init__(self, cluster: Cluster):
        b = cluster.services["decode-1"].metrics._labels
        self.b = {"role": b[0], "model": b[1], "instance": b[2]}
        self.before = self.now()

    def now(self) -> dict[str, float]:
        router = {"role": "router", "model": "tiny", "instance": "router"}
        values = {}
        for result in ("pulled", "timeout", "refused", "worker_lost", "cancelled"):
            labels = {**router, "result": result}
            values[f"export_{result}"] = REGISTRY.get_sample_value(
                "baton_router_peer_exports_total", labels
            )
        for result in ("received", "recomputed", "unused"):
            labels = {**self.b, "result": result}
            values[f"pull_{result}"] = REGISTRY.get_sample_value(
                "baton_kv_peer_pulls_total", labels
            )
        peer = {**self.b, "source": "peer"}
        for name in ("blocks", "reused_blocks"):
            values[name] = REGISTRY.get_sample_value(f"baton_kv_receive_{name}_total", peer)
        return {k: v or 0.0 for k, v in values.items()}

    def moved(self) -> dict[str, float]:
        """The series that moved since construction, by how much."""
        now = self.now()
        return {k: now[k] - self.before[k] for k in now if now[k] != self.before[k]}


def reference(model_dir) -> list[int]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    return list(out[0].token_ids)


def prefix_blocks(cluster: Cluster) -> int:
    """Full blocks of LONG_PREFIX's tokens that decode-1 may pull (it computes >= 1 token)."""
    engine = cluster.services["decode-0"].engine
    n_prefix = len(engine.tokenizer.encode(LONG_PREFIX))
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    return min(n_prefix // BS, (n_prompt - 1) // BS)


def test_a_prefix_computed_on_one_worker_is_pulled_by_the_other(model_dir):
    want = reference(model_dir)
    cluster = peer_cluster(model_dir)
    series = Series(cluster)
    blocks = prefix_blocks(cluster)
    assert blocks >= 4

    async def body(router):
        return await warm_then_ask(cluster, router, blocks)

    tokens, _, final = run(cluster, body)
    assert tokens == want
    assert final.timing.decode_worker == "decode-1"
    b = cluster.services["decode-1"].engine.handoff
    # B received the prefix's blocks instead of computing them: its computed prompt
    # tokens are the prompt's minus those.
    assert b.num_receive_blocks == blocks and b.num_reused_blocks == 0
    assert final.usage.cached_prompt_tokens == blocks * BS
    assert cluster.router.peers.num_pulled == 1 and cluster.router.peers.num_fallbacks == 0
    assert series.moved() == {"export_pulled": 1, "pull_received": 1, "blocks": blocks}


def test_a_slow_export_falls_back_to_recompute_and_frees_the_exporter(model_dir):
    want = reference(model_dir)
    cluster = peer_cluster(model_dir, peer_export_timeout_s=0.001)  # never in time
    series = Series(cluster)

    async def body(router):
        return await warm_then_ask(cluster, router, prefix_blocks(cluster))

    tokens, _, final = run(cluster, body)  # settled: A's late handles were declined
    assert tokens == want
    assert final.usage.cached_prompt_tokens == 0
    assert cluster.services["decode-1"].engine.handoff.num_receive_blocks == 0
    assert cluster.router.peers.num_fallbacks == 1
    assert series.moved() == {"export_timeout": 1}  # B was never sent the handles


def test_a_failed_peer_transfer_recomputes_on_the_puller(model_dir):
    want = reference(model_dir)
    cluster = peer_cluster(model_dir)
    cluster.fabric.hold_transfers = True  # the READ never lands: B's receive times out
    series = Series(cluster)

    async def body(router):
        return await warm_then_ask(cluster, router, prefix_blocks(cluster))

    tokens, _, final = run(cluster, body)  # settled: B's "failed" notice ended A's lease
    assert tokens == want
    assert final.usage.cached_prompt_tokens == 0  # recomputed from its own (empty) prefix
    assert cluster.router.peers.num_pulled == 1  # the handles went out; the pull failed
    moved = series.moved()
    assert moved.pop("blocks") == prefix_blocks(cluster)  # asked, never landed
    assert moved == {"export_pulled": 1, "pull_recomputed": 1}


def test_choose_source_takes_the_longest_prefix_when_it_is_worth_it():
    hashes = (1, 2, 3, 4, 5, 6)
    target = WorkerState("b", cached_hashes=frozenset({1}))
    workers = [
        target,
        WorkerState("a", cached_hashes=frozenset(hashes), num_running=3),
        WorkerState("c", cached_hashes=frozenset(hashes)),  # as long, less loaded
        WorkerState("d", healthy=False, cached_hashes=frozenset(hashes)),
    ]
    # 60 prompt tokens: at most 7 blocks leave a token to compute; 6 are held.
    assert choose_source(target, workers, hashes, 60, 8, 4) == PeerSource("c", 6)
    assert choose_source(target, workers, hashes, 60, 8, 6) is None  # 5 more than b's own
    # A prompt of exactly 4 blocks: the target computes the last token itself, so only 3.
    assert choose_source(target, workers, hashes, 32, 8, 2) == PeerSource("c", 3)
    assert choose_source(target, [target], hashes, 60, 8, 1) is None
    # A prefix held in a worker's host tier counts (its export onboards it first), and so
    # does the target's own tier (it onboards rather than pulls).
    in_tier = WorkerState("e", tier_hashes=(("host", frozenset(hashes)),))
    assert choose_source(target, [target, in_tier], hashes, 60, 8, 4) == PeerSource("e", 6)
    covered = WorkerState("b", tier_hashes=(("disk", frozenset(hashes[:4])),))
    assert choose_source(covered, [covered, in_tier], hashes, 60, 8, 4) is None


class _Exporter:
    """A stand-in for worker A's client: records the export, ends it as told."""

    def __init__(self, name: str, refuse: bool = False):
        self.name, self.refuse = name, refuse
        self.client = self
        self.aborted: list[str] = []

    async def submit(self, item):
        if self.refuse:
            raise RuntimeError("worker A refused the work")
        self.export_id = item.request_id

    async def abort(self, request_id: str):
        self.aborted.append(request_id)


def test_each_failed_export_counts_under_its_cause_and_gives_no_handles():
    """The router's series by result, for the failures the in-process flow above does not
    reach: A refuses the work, A dies before its handles come."""

    def count(result: str) -> float:
        labels = {"role": "router", "model": "unit", "instance": "router", "result": result}
        return REGISTRY.get_sample_value("baton_router_peer_exports_total", labels) or 0.0

    async def main():
        async def decline(handles):
            raise AssertionError("no handles came: nothing to decline")

        exports = PeerExports(30.0, decline, model="unit")
        before = {r: count(r) for r in ("refused", "worker_lost", "timeout", "pulled")}
        assert await exports.export(_Exporter("a", refuse=True), range(40), 2, 8) is None
        lost = _Exporter("a")
        task = asyncio.create_task(exports.export(lost, range(40), 2, 8))
        while not hasattr(lost, "export_id"):
            await asyncio.sleep(0)
        exports.worker_lost("a")
        assert await task is None
        assert lost.aborted == [lost.export_id]
        moved = {r: count(r) - before[r] for r in before}
        assert moved == {"refused": 1, "worker_lost": 1, "timeout": 0, "pulled": 0}

    asyncio.run(main())


@pytest.mark.parametrize("second", ["another tenant", "another salt"])
def test_no_peer_pull_across_tenants_or_salts(model_dir, second):
    """Tenant "a" warms decode-0; the same prompt from another tenant (or tenant "a" with
    another ``cache_salt``) lands on decode-1: its hashes match none of decode-0's, so the
    router asks no export, nothing is pulled, and nothing counts as cached."""
    want = reference(model_dir)
    cluster = peer_cluster(model_dir)
    series = Series(cluster)
    blocks = prefix_blocks(cluster)

    async def ask(router, request, tenant: str, salt: str = ""):
        typed = replace(generate_request(request), tenant=tenant, cache_salt=salt)
        tokens, final = [], None
        async for event in router.generate(typed):
            tokens.extend(event.delta.token_ids)
            final = event.finish or final
        return tokens, final

    async def body(router):
        _, first = await ask(router, req(LONG_PREFIX, max_tokens=1, request_id="warm"), "a")
        holder = router.decode[0]
        while len(holder.hashes) < blocks:  # decode-0's report with the warm prefix
            await asyncio.sleep(0.01)
        tenant, salt = ("b", "") if second == "another tenant" else ("a", "other")
        result = await ask(router, req(PROMPT, request_id="second"), tenant, salt)
        await cluster.settled()
        return first, result

    first, (tokens, final) = run(cluster, body)
    assert first.timing.decode_worker == "decode-0"
    assert tokens == want
    assert final.timing.decode_worker == "decode-1"
    assert final.usage.cached_prompt_tokens == 0
    assert cluster.services["decode-1"].engine.handoff.num_receive_blocks == 0
    assert cluster.router.peers.num_pulled == 0 and cluster.router.peers.num_fallbacks == 0
    assert series.moved() == {}
