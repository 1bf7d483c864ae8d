"""The latent (MLA) cache's hand-off: one entry per layer, one head, replicated on every TP rank.

Layout: ``[num_blocks, num_layers, 1, 1, block_size, kv_lora_rank + qk_rope_head_dim]``.
What must hold: the layout's geometry and bytes per token; a block is one segment; a latent
and a K/V layout refuse each other; and with tensor parallelism each decode rank takes
each block exactly once, from the prefill rank that the round robin names (so a request's
reads are spread over the prefill ranks, not all on rank 0), pull and push, a partial
receive included, with every prefill rank's lease released and nothing left in use.
"""

from __future__ import annotations

import threading
import time

import nixl  # noqa: F401  (required: the real backend; a broken install fails)
import pytest
import torch

from kvtransfer import KVConnector, KVTransferConfig, LayoutMismatchError, create_connector
from kvtransfer.layout import KVLayout
from kvtransfer.local_backend import LocalBackend, LocalFabric
from kvtransfer.messages import agent_name_for
from kvtransfer.tp_mapping import latent_block_sources, num_readers, plan_for_pair

LAYERS, BS, ROW = 3, 4, 40  # ROW: kv_lora_rank 32 + qk_rope_head_dim 8 (make-model tiny)


def latent_cache(num_blocks: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((num_blocks, LAYERS, 1, 1, BS, ROW), fill, dtype=torch.float32)


def latent_layout(cache: torch.Tensor, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    return KVLayout.from_tensor(
        cache, model_id="mla", num_kv_heads=1, tp_rank=tp_rank, tp_size=tp_size
    )


def test_latent_layout_geometry_and_one_segment_per_block():
    layout = latent_layout(latent_cache(8), tp_rank=1, tp_size=2)
    assert (layout.num_kv_entries, layout.num_kv_heads_local, layout.head_range) == (1, 1, (0, 1))
    assert layout.is_latent
    # (kv_lora_rank + qk_rope_head_dim) x element size x layers, per token.
    assert layout.bytes_per_token == ROW * 4 * LAYERS
    assert layout.block_bytes == BS * ROW * 4 * LAYERS == layout.block_stride
    assert layout.region_offset(2, 0, 0) == 2 * BS * ROW * 4
    with pytest.raises(ValueError, match="not held"):
        layout.region_offset(0, 1, 0)  # there is no V entry
    other = latent_layout(latent_cache(8), tp_rank=0, tp_size=1)
    (segment,) = plan_for_pair(other, layout)
    assert (segment.src_offset, segment.dst_offset, segment.length) == (0, 0, layout.block_bytes)


def test_latent_and_kv_pair_layouts_differ_in_fingerprint():
    latent = latent_layout(latent_cache(4))
    pair = KVLayout.from_tensor(
        torch.zeros(4, LAYERS, 2, 1, BS, ROW // 2), model_id="mla", num_kv_heads=1
    )
    assert pair.block_bytes == latent.block_bytes
    assert pair.fingerprint != latent.fingerprint
    with pytest.raises(ValueError, match="a latent cache has 1 kv head, got 2"):
        KVLayout.from_tensor(
            torch.zeros(4, LAYERS, 1, 1, BS, ROW), model_id="m", num_kv_heads=2, tp_size=2
        )
    with pytest.raises(ValueError, match=r"2 \(K, V\) or 1 \(latent\)"):
        KVLayout.from_tensor(torch.zeros(4, LAYERS, 3, 1, BS, ROW), model_id="m", num_kv_heads=1)


def test_round_robin_covers_every_block_once_and_starts_apart():
    for p in (1, 2, 3):
        for d in (1, 2, 4):
            for first in (0, 1):
                for n in (1, 2, 5):
                    plans = [latent_block_sources(first, n, range(p), r) for r in range(d)]
                    for plan in plans:
                        assert sorted(i for pos in plan.values() for i in pos) == list(range(n))
                        assert set(plan) == set(range(p))
                    # Decode ranks read block `first` from different prefill ranks.
                    starts = [next(r for r, pos in plan.items() if 0 in pos) for plan in plans]
                    assert starts == [(first + r) % p for r in range(d)]
            assert num_readers(1, 0, p, d, is_latent=True) == d


class Side:
    """One rank: a latent cache, a connector on the local fabric, what it holds."""

    def __init__(self, fabric, worker_id, cache, tp_rank, tp_size, direction):
        self.cache = cache
        self.layout = latent_layout(cache, tp_rank, tp_size)
        self.released: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        if fabric is None:  # real NIXL agents, in this process
            config = KVTransferConfig(backend="nixl", direction=direction, transfer_timeout_s=10)
            self.conn = create_connector(config, self.layout, cache, worker_id, self._on_release)
            return
        config = KVTransferConfig(
            backend="local", direction=direction, transfer_timeout_s=5, idle_poll_s=0.002
        )
        name = agent_name_for(worker_id, "1")
        backend = LocalBackend(name, cache, self.layout, fabric)
        self.conn = KVConnector(
            backend, self.layout, config, worker_id, "1", self._on_release, time.monotonic
        )

    def _on_release(self, req_id, reason):
        with self._lock:
            self.released.append((req_id, reason))


def wait_until(predicate, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize(
    "p, d, backend",
    [(2, 1, "local"), (2, 2, "local"), (1, 2, "local"), (3, 2, "local"), (2, 2, "nixl")],
)
def test_each_block_is_read_once_from_its_round_robin_rank(p, d, backend, direction):
    fabric = LocalFabric() if backend == "local" else None
    # Each prefill rank's copy of the latent is tagged with its rank (a real worker's
    # copies are equal): the decode side then shows where each block came from.
    prefill = [
        Side(fabric, f"P#{r}", latent_cache(16, fill=r + 1.0), r, p, direction) for r in range(p)
    ]
    decode = [Side(fabric, f"D#{r}", latent_cache(12), r, d, direction) for r in range(d)]
    for a in prefill:
        for b in decode:
            a.conn.add_peer(b.conn.metadata())
            b.conn.add_peer(a.conn.metadata())
    try:
        src_ids, dst_ids = [3, 9, 4, 11, 7], [0, 5, 2, 8, 6]
        for n, first in ((5, 0), (5, 2), (1, 0)):  # (2: the decode side holds 2 blocks)
            req = f"r{n}-{first}"
            handles = [
                s.conn.offer(
                    req, src_ids[:n], num_tokens=n * BS, first_token_id=1, dst_tp_size=d
                ).from_block(first)
                for s in prefill
            ]
            for rank in decode:
                rank.cache.zero_()
                result = rank.conn.receive(handles, dst_ids[first:n]).result(timeout=10)
                # Each received block once, wherever it came from: no per-rank copies.
                assert result.num_bytes == (n - first) * rank.layout.block_bytes
                for i, block in enumerate(dst_ids[first:n]):
                    source = (first + i + rank.layout.tp_rank) % p
                    assert torch.all(rank.cache[block] == source + 1.0), (req, i, block)
                untouched = [b for b in range(12) if b not in dst_ids[first:n]]
                assert not rank.cache[untouched].any()
            # Every prefill rank hears from every decode rank (its share read: "done", or
            # none: "skipped"), so each lease ends now, once, long before it would expire.
            for side in prefill:
                assert wait_until(lambda s=side, r=req: any(x == r for x, _ in s.released))
                side.conn.sync()
                (reason,) = [why for x, why in side.released if x == req]
                assert reason in ("done", "skipped")
            assert all(s.conn.stats().num_leases == 0 for s in prefill)
            assert all(s.conn.stats().num_incoming == 0 for s in decode)
    finally:
        for side in prefill + decode:
            side.conn.close()


def test_latent_and_kv_pair_connectors_refuse_each_other():
    fabric = LocalFabric()
    latent = Side(fabric, "P#0", latent_cache(4), 0, 1, "pull")
    pair_cache = torch.zeros(4, LAYERS, 2, 1, BS, ROW // 2)
    pair_layout = KVLayout.from_tensor(pair_cache, model_id="mla", num_kv_heads=1)
    backend = LocalBackend("D#0:1", pair_cache, pair_layout, fabric)
    pair = KVConnector(
        backend, pair_layout, KVTransferConfig(backend="local"), "D#0", "1", lambda *_: None
    )
    try:
        with pytest.raises(LayoutMismatchError, match="num_kv_entries: local 2 != remote 1"):
            pair.add_peer(latent.conn.metadata())
    finally:
        latent.conn.close()
        pair.close()
