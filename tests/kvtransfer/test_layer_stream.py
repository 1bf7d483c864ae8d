"""The layer-wise hand-off over the in-process backend: a prefill rank writes a request's
layer groups into blocks a decode rank reserved, with the stream's one notice.

What must hold: every (block, layer, K/V, head) the decode rank owns arrives, bit for
bit, and nothing else is touched, with equal and different TP sizes, pipeline stages on
the prefill side and the FP8 cache; the receive completes only after the last group
(never earlier); a write failing after some groups fails both sides' futures once
nothing is in flight; a decode-side abort stops the writer.
"""

from __future__ import annotations

import time

import nixl  # noqa: F401  (required: the real backend; a broken install fails)
import pytest
import torch

from kvtransfer import KVConnector, KVTransferConfig, KVTransferError, TransferAbortedError
from kvtransfer.faults import FaultConfig, FaultyBackend
from kvtransfer.layerwise import layer_groups
from kvtransfer.layout import KVLayout
from kvtransfer.local_backend import LocalBackend, LocalFabric
from kvtransfer.messages import agent_name_for

from .helpers import empty_cache, full_kv, rank_cache

HEADS, LAYERS = 4, 4


def make_conn(fabric, worker_id, cache, *, tp_rank=0, tp_size=1, first_layer=0, faults=None):
    layout = KVLayout.from_tensor(
        cache, model_id="m", num_kv_heads=HEADS, tp_rank=tp_rank, tp_size=tp_size,
        first_layer=first_layer, total_num_layers=LAYERS,
    )  # fmt: skip
    config = KVTransferConfig(
        backend="local", direction="push", transfer_timeout_s=3, idle_poll_s=0.002
    )
    name = agent_name_for(worker_id, "1")
    backend = LocalBackend(name, cache, layout, fabric)
    if faults is not None:
        backend = FaultyBackend(backend, faults, worker_id)
    return KVConnector(backend, layout, config, worker_id, "1", lambda rid, why: None)


def connect(*conns):
    for a in conns:
        for b in conns:
            if a is not b:
                a.add_peer(b.metadata())


def stream(prefill_conns, reservations, src_blocks, group_size, chunk_blocks=None):
    """Every prefill rank writes its layers of ``src_blocks`` in groups, chunk by chunk."""
    chunk_blocks = chunk_blocks or [len(src_blocks)]
    futures = [c.open_stream("r", reservations) for c in prefill_conns]
    for conn in prefill_conns:
        first, stage = 0, conn.layout.layer_range
        for k, n in enumerate(chunk_blocks):
            groups = layer_groups(stage[1] - stage[0], group_size)
            for i, (start, end) in enumerate(groups):
                is_last = k == len(chunk_blocks) - 1 and i == len(groups) - 1
                layers = (stage[0] + start, stage[0] + end)
                conn.write_layers("r", first, src_blocks[first : first + n], layers,
                                  layers[1], is_last)  # fmt: skip
            first += n
    return futures


@pytest.mark.parametrize("group_size", [1, 3, 4])
@pytest.mark.parametrize(("p_tp", "d_tp", "p_pp"), [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_streamed_layer_groups_arrive_exactly(group_size, p_tp, d_tp, p_pp):
    full = full_kv(10, num_layers=LAYERS, num_kv_heads=HEADS, seed=1)
    fabric = LocalFabric()
    src_blocks, dst_blocks = [1, 2, 5, 6, 7], [8, 3, 4, 0, 9]
    prefill = []
    for stage in range(p_pp):
        lo, hi = stage * LAYERS // p_pp, (stage + 1) * LAYERS // p_pp
        for r in range(p_tp):
            cache = rank_cache(full, r, p_tp)[:, lo:hi].contiguous()
            prefill.append(make_conn(fabric, f"p{stage}{r}", cache, tp_rank=r, tp_size=p_tp,
                                     first_layer=lo))  # fmt: skip
    decode = [
        make_conn(fabric, f"d{r}", empty_cache(full, r, d_tp, 10), tp_rank=r, tp_size=d_tp)
        for r in range(d_tp)
    ]
    caches = [d._backend.memory for d in decode]
    try:
        connect(*prefill, *decode)
        names = [p.agent_name for p in prefill]
        waits = [d.expect_stream("r", dst_blocks, names) for d in decode]
        reservations = [reservation for reservation, _ in waits]
        sent = stream(prefill, reservations, src_blocks, group_size, chunk_blocks=[2, 3])
        for _, future in waits:
            result = future.result(5)
            assert result.num_bytes == len(dst_blocks) * decode[0].layout.block_bytes
        assert all(f.result(5) > 0 for f in sent)
        for r, conn in enumerate(decode):
            got = caches[r].view(full.dtype).view(empty_cache(full, r, d_tp, 10).shape)
            want = rank_cache(full, r, d_tp)
            assert torch.equal(got[dst_blocks], want[src_blocks])
            untouched = [b for b in range(10) if b not in dst_blocks]
            assert not got[untouched].any()
            assert conn.stats().num_streams == 0
    finally:
        for c in prefill + decode:
            c.close()


def test_fp8_cache_streams_values_and_scales():
    cache = torch.randint(0, 255, (6, LAYERS, 2, HEADS, 4, 8 + 4), dtype=torch.uint8)
    fabric = LocalFabric()
    p = make_conn(fabric, "p", cache)
    d = make_conn(fabric, "d", torch.zeros_like(cache))
    try:
        connect(p, d)
        reservation, future = d.expect_stream("r", [4, 5], [p.agent_name])
        (sent,) = stream([p], [reservation], [0, 1], 2)
        future.result(5)
        sent.result(5)
        got = d._backend.memory.view(cache.shape)
        assert torch.equal(got[[4, 5]], cache[[0, 1]]) and not got[:4].any()
    finally:
        p.close()
        d.close()


def test_receive_completes_only_after_the_last_group():
    full = full_kv(4, num_layers=LAYERS, num_kv_heads=HEADS, seed=2)
    fabric = LocalFabric()
    p = make_conn(fabric, "p", full.clone())
    d = make_conn(fabric, "d", empty_cache(full, 0, 1, 4))
    try:
        connect(p, d)
        reservation, future = d.expect_stream("r", [2, 3], [p.agent_name])
        (sent,) = [p.open_stream("r", [reservation])]
        for layer in range(LAYERS - 1):
            p.write_layers("r", 0, [0, 1], (layer, layer + 1), layer + 1)
        time.sleep(0.05)
        p.sync()
        d.sync()
        assert not future.done() and not sent.done()
        got = d._backend.memory.view(full.dtype).view(full.shape)
        assert torch.equal(got[[2, 3], : LAYERS - 1], full[[0, 1], : LAYERS - 1])  # streamed
        assert not got[[2, 3], LAYERS - 1].any()
        p.write_layers("r", 0, [0, 1], (LAYERS - 1, LAYERS), LAYERS, is_last=True)
        assert future.result(5).num_descriptors == LAYERS  # one notice counted the writes
        assert sent.result(5) == 2 * d.layout.block_bytes
    finally:
        p.close()
        d.close()


def test_a_write_failing_after_some_groups_fails_both_sides_once_nothing_is_in_flight():
    full = full_kv(4, num_layers=LAYERS, num_kv_heads=HEADS, seed=3)
    fabric = LocalFabric()
    p = make_conn(fabric, "p", full.clone(), faults=FaultConfig(fail_every=3))
    d = make_conn(fabric, "d", empty_cache(full, 0, 1, 4))
    try:
        connect(p, d)
        reservation, future = d.expect_stream("r", [2, 3], [p.agent_name])
        (sent,) = stream([p], [reservation], [0, 1], 1)  # the third write fails
        with pytest.raises(KVTransferError):
            future.result(5)
        with pytest.raises(KVTransferError):
            sent.result(5)
        assert p.stats().num_streams == 0 and d.stats().num_streams == 0
    finally:
        p.close()
        d.close()


def test_decode_abort_stops_the_writer_and_both_futures_end():
    full = full_kv(4, num_layers=LAYERS, num_kv_heads=HEADS, seed=4)
    fabric = LocalFabric()
    p = make_conn(fabric, "p", full.clone())
    d = make_conn(fabric, "d", empty_cache(full, 0, 1, 4))
    try:
        connect(p, d)
        reservation, future = d.expect_stream("r", [2, 3], [p.agent_name])
        sent = p.open_stream("r", [reservation])
        p.write_layers("r", 0, [0, 1], (0, 1), 1)
        d.abort("r")
        with pytest.raises(TransferAbortedError):
            future.result(5)
        with pytest.raises(KVTransferError):
            sent.result(5)
        p.write_layers("r", 0, [0, 1], (1, 2), 2)  # after the end: ignored
        p.sync()
        assert p.stats().num_streams == 0 and d.stats().num_streams == 0
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("p_tp", [1, 2])
def test_layer_groups_over_nixl(p_tp):
    """The same over two real NIXL agents per side: descriptor lists of each layer group
    prepared on first use, the one notice riding on the last WRITE."""
    from kvtransfer import create_connector

    full = full_kv(8, num_layers=LAYERS, num_kv_heads=HEADS, seed=5)
    config = KVTransferConfig(direction="push", transfer_timeout_s=5)

    def conn(name, cache, rank, tp):
        layout = KVLayout.from_tensor(
            cache, model_id="m", num_kv_heads=HEADS, tp_rank=rank, tp_size=tp
        )
        return create_connector(config, layout, cache, name, lambda rid, why: None)

    p_caches = [rank_cache(full, r, p_tp) for r in range(p_tp)]
    prefill = [conn(f"p{r}", c, r, p_tp) for r, c in enumerate(p_caches)]
    d_cache = empty_cache(full, 0, 1, 8)
    decode = conn("d", d_cache, 0, 1)
    try:
        connect(*prefill, decode)
        reservation, future = decode.expect_stream("r", [7, 6, 2], [p.agent_name for p in prefill])
        sent = stream(prefill, [reservation], [0, 1, 2], 3, chunk_blocks=[1, 2])
        assert future.result(10).num_bytes == 3 * decode.layout.block_bytes
        assert all(f.result(10) > 0 for f in sent)
        assert torch.equal(d_cache[[7, 6, 2]], full[[0, 1, 2]])
        assert not d_cache[[0, 1, 3, 4, 5]].any()
    finally:
        for c in [*prefill, decode]:
            c.close()


def test_the_timeline_follows_the_prediction_with_a_capped_link():
    """Injected compute (a sleep per layer) and a capped link make the timeline
    deterministic enough to check against ``predict_ttft``."""
    from kvtransfer.layerwise import LayerwiseCost, predict_ttft

    full = full_kv(8, num_layers=LAYERS, num_kv_heads=HEADS, seed=6)
    blocks = [0, 1, 2, 3, 4, 5]
    layer_bytes = len(blocks) * full[0, 0].numel() * full.element_size()
    layer_s, per_transfer_s = 0.03, 0.002
    bandwidth = layer_bytes / 0.02  # a layer moves in 20 ms, computes in 30
    fabric = LocalFabric(bandwidth=bandwidth, per_transfer_s=per_transfer_s)
    p = make_conn(fabric, "p", full.clone())
    d = make_conn(fabric, "d", empty_cache(full, 0, 1, 8))
    cost = LayerwiseCost(LAYERS, (layer_s,), (layer_bytes,), bandwidth, per_transfer_s)
    try:
        connect(p, d)
        measured = {}
        for group_size in (1, LAYERS):
            reservation, future = d.expect_stream(f"r{group_size}", blocks, [p.agent_name])
            t0 = time.perf_counter()
            sent = p.open_stream(f"r{group_size}", [reservation])
            for start, end in layer_groups(LAYERS, group_size):
                time.sleep((end - start) * layer_s)  # the group's compute
                p.write_layers(f"r{group_size}", 0, blocks, (start, end), end, end == LAYERS)
            future.result(5)
            measured[group_size] = time.perf_counter() - t0
            sent.result(5)
        for group_size, seconds in measured.items():
            predicted = predict_ttft(cost, group_size if group_size < LAYERS else None)
            assert predicted <= seconds < predicted * 1.25 + 0.01, (group_size, seconds)
        assert measured[1] < measured[LAYERS] - 0.04  # 80 ms of transfer, 60 hidden
    finally:
        p.close()
        d.close()
