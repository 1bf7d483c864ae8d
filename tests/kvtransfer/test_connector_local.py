"""The connector's lifetimes over the in-process backend: leases, notices, aborts, deadlines.

Each test has a prefill side and a decode side, each a connector with its own thread
and a real cache tensor; "in use" is tracked like a worker would: prefill blocks until
``on_release``, decode blocks until the receive's future completes.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import msgspec
import pytest
import torch

from kvtransfer import (
    KVConnector,
    KVTransferConfig,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerLostError,
    TransferAbortedError,
    TransferTimeoutError,
)
from kvtransfer.local_backend import LocalBackend, LocalFabric
from kvtransfer.messages import agent_name_for

from .helpers import empty_cache, full_kv, layout_of, rank_cache

HEADS = 4


class Side:
    """One worker rank: a cache, a connector, and the blocks it holds."""

    def __init__(self, fabric, worker_id, cache, tp_rank=0, tp_size=1, direction="pull",
                 clock=time.monotonic, incarnation="1"):  # fmt: skip
        self.cache = cache
        self.layout = layout_of(cache, HEADS, tp_rank, tp_size)
        self.released: list[tuple[str, str]] = []
        self.in_use: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        config = KVTransferConfig(
            backend="local", direction=direction, transfer_timeout_s=5, idle_poll_s=0.002
        )
        name = agent_name_for(worker_id, incarnation)
        backend = LocalBackend(name, cache, self.layout, fabric)
        self.conn = KVConnector(
            backend, self.layout, config, worker_id, incarnation, self._on_release, clock
        )

    def _on_release(self, req_id, reason):
        with self._lock:
            self.released.append((req_id, reason))
            self.in_use.pop(req_id, None)

    def offer(self, req_id, block_ids, dst_tp_size=1):
        with self._lock:
            self.in_use[req_id] = tuple(block_ids)
        return self.conn.offer(
            req_id, block_ids, num_tokens=len(block_ids) * 4, first_token_id=5,
            dst_tp_size=dst_tp_size,
        )  # fmt: skip


def connect(*sides):
    for a in sides:
        for b in sides:
            if a is not b:
                a.conn.add_peer(b.conn.metadata())


def wait_until(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def fabric():
    return LocalFabric()


def make_pair(fabric, direction="pull", p_blocks=32, d_blocks=24, clock=time.monotonic):
    full = full_kv(p_blocks, num_kv_heads=HEADS)
    prefill = Side(fabric, "prefill", full.clone(), clock=clock)
    decode = Side(
        fabric, "decode", empty_cache(full, 0, 1, d_blocks), direction=direction, clock=clock
    )
    connect(prefill, decode)
    return prefill, decode


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_many_requests_arrive_intact_and_everything_is_freed(fabric, direction):
    prefill, decode = make_pair(fabric, direction)
    rng = random.Random(1)
    src_free, dst_free = list(range(32)), list(range(24))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    jobs = []
    for i, n in enumerate([3, 1, 6, 4]):
        src, dst = [src_free.pop() for _ in range(n)], [dst_free.pop() for _ in range(n)]
        handle = prefill.offer(f"r{i}", src)
        jobs.append((src, dst, decode.conn.receive([handle], dst)))
    for src, dst, future in jobs:
        result = future.result(timeout=5)
        assert result.direction == direction
        assert result.num_bytes == len(src) * prefill.layout.block_bytes
        assert torch.equal(decode.cache[dst], prefill.cache[src])
    assert wait_until(lambda: len(prefill.released) == 4)
    assert {reason for _, reason in prefill.released} == {"done"}
    assert prefill.in_use == {}
    assert prefill.conn.stats().num_leases == 0 and decode.conn.stats().num_incoming == 0
    prefill.conn.close()
    decode.conn.close()


def test_consecutive_blocks_merge_into_one_descriptor(fabric):
    prefill, decode = make_pair(fabric)
    handle = prefill.offer("a", [4, 5, 6, 7, 12])
    result = decode.conn.receive([handle], [0, 1, 2, 3, 9]).result(timeout=5)
    assert result.num_descriptors == 2


def test_decline_and_late_or_duplicate_notices(fabric):
    prefill, decode = make_pair(fabric)
    a, b = prefill.offer("a", [1, 2]), prefill.offer("b", [3])
    decode.conn.decline([a], "skipped")  # e.g. a full prefix hit on the decode side
    assert wait_until(lambda: prefill.released == [("a", "skipped")])
    decode.conn.receive([b], [0]).result(timeout=5)
    assert wait_until(lambda: len(prefill.released) == 2)
    decode.conn.decline([a, b], "aborted")  # late and duplicate: nothing happens
    prefill.conn.sync()
    assert prefill.released == [("a", "skipped"), ("b", "done")]


def test_lease_expiry_frees_and_a_stale_handle_is_refused(fabric):
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    prefill, decode = make_pair(fabric, clock=clock)
    handle = prefill.offer("a", [1, 2, 3])
    clock.now = 29.0
    prefill.conn.sync()
    assert prefill.released == []
    clock.now = 30.5
    prefill.conn.sync()
    assert prefill.released == [("a", "expired")] and prefill.in_use == {}
    stale = msgspec.structs.replace(handle, issued_unix=time.time() - 29)
    with pytest.raises(LeaseExpiredError):
        decode.conn.receive([stale], [0, 1, 2]).result(timeout=5)
    assert torch.count_nonzero(decode.cache) == 0


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_abort_during_transfer_leaves_nothing_held(direction):
    fabric = LocalFabric(hold_transfers=True)
    prefill, decode = make_pair(fabric, direction)
    handle = prefill.offer("a", [3, 9, 4])
    future = decode.conn.receive([handle], [5, 6, 7])
    if direction == "push":  # the write is posted once prefill got the push request
        assert wait_until(lambda: prefill.conn.stats().num_outgoing == 1)
    decode.conn.abort("a")
    with pytest.raises(TransferAbortedError):
        future.result(timeout=5)
    assert wait_until(lambda: prefill.released == [("a", "aborted")])
    assert fabric.complete_held() == 0  # the cancelled transfer never runs
    assert torch.count_nonzero(decode.cache) == 0
    assert prefill.conn.stats().num_outgoing == 0 and decode.conn.stats().num_incoming == 0


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_hung_transfer_times_out_and_frees_both_sides(direction):
    fabric = LocalFabric(hold_transfers=True)
    prefill, decode = make_pair(fabric, direction)
    handle = prefill.offer("a", [1, 2])
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        decode.conn.receive([handle], [0, 1], timeout_s=0.3).result(timeout=5)
    assert time.monotonic() - start < 2.0
    assert wait_until(lambda: len(prefill.released) == 1)
    assert prefill.in_use == {}


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_killed_peer_gives_a_typed_error_and_only_a_new_incarnation_is_accepted(fabric, direction):
    prefill, decode = make_pair(fabric, direction)
    handle = prefill.offer("a", [1, 2])
    old_metadata = prefill.conn.metadata()
    fabric.kill(prefill.conn.agent_name)
    start = time.monotonic()
    with pytest.raises(PeerLostError):
        decode.conn.receive([handle], [0, 1]).result(timeout=5)
    assert time.monotonic() - start < 1.0
    with pytest.raises(PeerLostError, match="dead incarnation"):
        decode.conn.add_peer(old_metadata)
    reborn = Side(fabric, "prefill", prefill.cache, incarnation="2")
    connect(reborn, decode)
    handle = reborn.offer("b", [3, 4])
    decode.conn.receive([handle], [2, 3]).result(timeout=5)
    assert torch.equal(decode.cache[[2, 3]], prefill.cache[[3, 4]])


def test_killed_during_transfer():
    fabric = LocalFabric(hold_transfers=True)
    prefill, decode = make_pair(fabric)
    future = decode.conn.receive([prefill.offer("a", [1, 2])], [0, 1])
    fabric.kill(prefill.conn.agent_name)
    fabric.complete_held()
    with pytest.raises(PeerLostError):
        future.result(timeout=5)
    assert decode.conn.stats().num_peers == 0


def test_mismatched_layout_is_refused_with_what_differs(fabric):
    full = full_kv(8, num_kv_heads=HEADS)
    prefill = Side(fabric, "prefill", full.clone())
    decode = Side(fabric, "decode", torch.zeros(8, 2, 2, HEADS, 16, 8, dtype=full.dtype))
    with pytest.raises(LayoutMismatchError, match="block_size: local 16 != remote 4"):
        decode.conn.add_peer(prefill.conn.metadata())
    with pytest.raises(LayoutMismatchError):
        prefill.conn.add_peer(decode.conn.metadata())


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_heterogeneous_tp_reassembles_the_same_kv(fabric, p, d, direction):
    full = full_kv(16, num_kv_heads=HEADS, seed=3)
    prefills = [Side(fabric, f"p{r}", rank_cache(full, r, p), r, p) for r in range(p)]
    decodes = [
        Side(fabric, f"d{r}", empty_cache(full, r, d, 16), r, d, direction=direction)
        for r in range(d)
    ]
    connect(*prefills, *decodes)
    src, dst = [11, 2, 7, 3], [0, 9, 4, 15]
    handles = [side.offer("a", src, dst_tp_size=d) for side in prefills]
    for side in decodes:
        side.conn.receive(handles, dst).result(timeout=5)
    reassembled = torch.cat([side.cache[dst] for side in decodes], dim=3)
    assert torch.equal(reassembled, full[src])
    for side in prefills:
        assert wait_until(lambda side=side: side.released == [("a", "done")])


def test_config_names_the_bad_key():
    with pytest.raises(ValueError, match=r"kv_transfer\.direction"):
        KVTransferConfig(direction="sideways")
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        KVTransferConfig(lease_seconds=5, transfer_timeout_s=10)
    with pytest.raises(ValueError, match=r"kv_transfer\.backend"):
        KVTransferConfig(backend="carrier-pigeon")
    assert KVTransferConfig().direction == "auto"


def test_auto_direction_follows_the_transport():
    from kvtransfer.nixl_backend import preferred_direction

    layout = layout_of(torch.zeros(2, 2, 2, HEADS, 4, 8), HEADS)
    assert preferred_direction(layout, "") == "pull"  # shared memory (cma) on one host
    assert preferred_direction(layout, "tcp") == "push"  # READ is emulated over TCP
    assert preferred_direction(layout, "rc,tcp") == "pull"
    cuda = dataclasses.replace(layout, device="cuda:0")
    assert preferred_direction(cuda, "") == "push"
