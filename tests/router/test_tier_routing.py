"""``kv_aware`` over every KV tier (router/policy.py), and the router's per-tier hash sets
kept from the workers' numbered stored / removed events (router/workers.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import msgspec
import pytest

from router.policy import KVWeights, RouteRequest, WorkerState, cached_prefix_blocks, pick, route
from router.status import TierUsage, cluster_status
from router.workers import WorkerView
from workers.protocol.block_hashes import hash_prompt_blocks
from workers.protocol.wire import KVEvents, TierStatus, WorkerReport

BS = 4
PROMPT = list(range(40))  # 10 full blocks
HASHES = tuple(hash_prompt_blocks(PROMPT, BS))
REQ = RouteRequest(len(PROMPT), HASHES, BS)


def worker(name: str, g1: int = 0, host: range = range(0), disk: range = range(0), **kw):
    """A worker holding prompt blocks [0, g1) in its pool and the given ranges below it."""
    tiers = (("host", {HASHES[i] for i in host}), ("disk", {HASHES[i] for i in disk}))
    return WorkerState(name, cached_hashes=frozenset(HASHES[:g1]), tier_hashes=tiers, **kw)


def test_the_cached_prefix_runs_through_every_tier_and_stops_at_the_first_missing_block():
    assert cached_prefix_blocks(worker("a", g1=3, host=range(3, 6), disk=range(6, 8)), HASHES) == 8
    # Block 3 is nowhere: what follows it (on disk) cannot be used.
    assert cached_prefix_blocks(worker("b", g1=3, disk=range(4, 10)), HASHES) == 3
    assert cached_prefix_blocks(worker("c", host=range(0, 10)), HASHES) == 10


def test_a_prefix_in_host_memory_beats_none_and_loses_to_the_pool():
    pool = [worker("none"), worker("host", host=range(10)), worker("g1", g1=10)]
    assert pick("kv_aware", pool, REQ, 0).name == "g1"
    assert pick("kv_aware", pool[:2], REQ, 0).name == "host"


def test_a_block_costs_the_weight_of_the_first_tier_in_lookup_order_that_holds_it():
    weights = KVWeights(overlap_weight=1.0, host_tier_weight=0.1, disk_tier_weight=0.5)
    req = RouteRequest(len(PROMPT), HASHES, BS, weights)
    # In both tiers: costed as host (looked up first). 10 blocks x 0.1 = 1 prefill block;
    # on disk only: 10 x 0.5 = 5. One with 3 blocks in use (1 + 3 = 4 < 5) still wins,
    # one with 5 (1 + 5 = 6 > 5) does not.
    both = worker("both", host=range(10), disk=range(10), kv_blocks_used=3)
    disk = worker("disk", disk=range(10))
    assert pick("kv_aware", [disk, both], req, 0).name == "both"
    busier = worker("both", host=range(10), disk=range(10), kv_blocks_used=5)
    assert pick("kv_aware", [disk, busier], req, 0).name == "disk"


def test_the_tier_weights_decide_between_disk_and_a_shorter_pool_prefix():
    # d holds the whole prompt on disk; p holds 6 blocks in its pool and must compute 4.
    d, p = worker("d", disk=range(10)), worker("p", g1=6)
    cheap_disk = RouteRequest(len(PROMPT), HASHES, BS, KVWeights(disk_tier_weight=0.3))
    dear_disk = RouteRequest(len(PROMPT), HASHES, BS, KVWeights(disk_tier_weight=0.5))
    assert pick("kv_aware", [p, d], cheap_disk, 0).name == "d"  # 3 < 4 blocks
    assert pick("kv_aware", [p, d], dear_disk, 0).name == "p"  # 5 > 4 blocks


@pytest.mark.parametrize(("tier", "local"), [("host", True), ("disk", True), ("none", False)])
def test_auto_disaggregation_counts_the_lower_tiers_as_cached(tier, local):
    ranges = (
        {"host": range(10)} if tier == "host" else {"disk": range(10)} if tier == "disk" else {}
    )
    decode = worker("decode-0", **ranges)
    decision = route(
        REQ,
        [worker("prefill-0")],
        [decode],
        policy="kv_aware",
        disaggregation="auto",
        auto_local_prefill_tokens=8,
        saturated_queue=8,
    )
    assert (decision.prefill is None) == local
    assert decision.cached_tokens == (len(PROMPT) if local else 0)


# ---- the router's view of a worker's tiers ----------------------------------------------


class Client:
    name, role = "decode-0", "decode"


def report(seq: int, *events: KVEvents, snapshot: bool = False) -> WorkerReport:
    return WorkerReport(
        name="decode-0", role="decode", healthy=True, num_running=0, num_waiting=0,
        kv_blocks_total=8, kv_blocks_used=0, kv_blocks_cached=0, num_held=0,
        kv_events_seq=seq, kv_events_snapshot=snapshot, kv_events=events,
    )  # fmt: skip


def held(view: WorkerView) -> dict[str, set[int]]:
    return {name: set(hashes) for name, hashes in view.state().tier_hashes}


def test_the_view_applies_a_snapshot_then_events_in_order():
    view = WorkerView(Client())
    view.update(report(1, KVEvents("host", (1, 2, 3)), KVEvents("disk", (9,)), snapshot=True))
    assert held(view) == {"host": {1, 2, 3}, "disk": {9}}
    view.update(report(2, KVEvents("host", (4,), (1,)), KVEvents("disk", (1,))))
    view.update(report(2))  # a heartbeat: nothing new
    view.update(report(3, KVEvents("host", (), (2,))))
    assert held(view) == {"host": {3, 4}, "disk": {9, 1}}
    assert [name for name, _ in view.state().tier_hashes] == ["host", "disk"]  # lookup order


def test_a_gap_forgets_the_tiers_until_the_next_snapshot(caplog):
    view = WorkerView(Client())
    view.update(report(1, KVEvents("host", (1, 2)), snapshot=True))
    with caplog.at_level(logging.WARNING, logger="router.workers"):
        view.update(report(3, KVEvents("host", (5,))))  # report 2 never came
    assert "events 2..2 missing" in caplog.text
    assert held(view) == {}  # unknown: count nothing rather than something wrong
    view.update(report(4, KVEvents("host", (6,))))  # still not trusted
    assert held(view) == {}
    view.update(report(5, KVEvents("host", (1, 2, 5, 6)), snapshot=True))
    view.update(report(6, KVEvents("host", (7,), (1,))))
    assert held(view) == {"host": {2, 5, 6, 7}}


def test_the_pools_own_events_keep_its_g1_hashes_apart_from_the_tiers(caplog):
    view = WorkerView(Client())
    view.update(report(1, KVEvents("pool", (1, 2)), KVEvents("host", (3,)), snapshot=True))
    assert view.state().cached_hashes == {1, 2} and held(view) == {"host": {3}}
    view.update(report(2, KVEvents("pool", (4,), (1,))))
    assert view.state().cached_hashes == {2, 4}
    with caplog.at_level(logging.WARNING, logger="router.workers"):
        view.update(report(4, KVEvents("pool", (5,))))  # report 3 never came
    assert view.state().cached_hashes == set() and held(view) == {}
    view.update(report(5, KVEvents("pool", (2, 4, 5)), snapshot=True))
    assert view.state().cached_hashes == {2, 4, 5}


def test_a_restarted_workers_snapshot_replaces_the_dead_ones_tiers():
    view = WorkerView(Client())
    view.update(report(1, KVEvents("host", (1,)), KVEvents("disk", (2,)), snapshot=True))
    view.update(report(2, KVEvents("host", (3,))))
    # The new process numbers from 1 again and knows only what its disk kept.
    view.update(report(1, KVEvents("host", ()), KVEvents("disk", (2,)), snapshot=True))
    assert held(view) == {"host": set(), "disk": {2}}
    view.update(report(2, KVEvents("host", (8,))))
    assert held(view) == {"host": {8}, "disk": {2}}


def test_the_status_shows_each_workers_tiers_from_its_last_report():
    view = WorkerView(Client())
    host = TierStatus("host", 3, 3 * 64, 16, 16 * 64, 5, 2, 0, 320, 0.01, 640, 0.02, 1, 0)
    view.update(msgspec.structs.replace(report(1, snapshot=True), kv_tiers=(host,)))
    config = SimpleNamespace(
        model_name="tiny", kv_transfer_backend="local", policy="kv_aware",
        disaggregation="auto", speculative="", fault_injection=False,
    )  # fmt: skip
    router = SimpleNamespace(
        config=config, prefill=[], decode=[view], recovery=None, is_draining=False
    )
    (pool,) = [p for p in cluster_status(router).pools if p.workers]
    assert pool.workers[0].kv_tiers == (TierUsage("host", 3, 192, 16, 1024, 5, 2),)
    assert WorkerView(Client()).report is None  # no report yet: no tiers shown
    router.decode = [WorkerView(Client())]
    assert cluster_status(router).pools[1].workers[0].kv_tiers == ()
