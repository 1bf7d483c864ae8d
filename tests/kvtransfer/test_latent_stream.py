"""A latent (MLA) cache streamed layer-wise from a prefill stage of several TP ranks.

Every prefill rank of a stage holds the whole latent, so each block is written by one
of them, the same round robin as the whole-request hand-off: block ``b`` from prefill
rank ``(b + decode rank) % prefill TP`` (``tp_mapping.latent_block_sources``). Here each
prefill rank's cache is marked with its rank, so the decode side sees who wrote each
block. What must hold: every block arrives exactly once, from the rank the round robin
names, layer group by layer group; each prefill rank writes only its share of the bytes
(and still says "done" when its share is empty); a partial receive keeps the absolute
block positions; nothing else of the decode cache is touched.
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer import KVConnector, KVTransferConfig
from kvtransfer.layerwise import layer_groups
from kvtransfer.layout import KVLayout
from kvtransfer.local_backend import LocalBackend, LocalFabric
from kvtransfer.messages import agent_name_for
from kvtransfer.tp_mapping import latent_block_sources

LAYERS, BS, ROW = 3, 4, 40


def latent_conn(fabric, worker_id: str, cache: torch.Tensor, tp_rank: int, tp_size: int):
    layout = KVLayout.from_tensor(
        cache, model_id="mla", num_kv_heads=1, tp_rank=tp_rank, tp_size=tp_size
    )
    config = KVTransferConfig(backend="local", direction="push", transfer_timeout_s=3)
    backend = LocalBackend(agent_name_for(worker_id, "1"), cache, layout, fabric)
    return KVConnector(backend, layout, config, worker_id, "1", lambda rid, why: None)


@pytest.mark.parametrize("first_block", [0, 1])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (2, 2), (3, 2)])
def test_latent_blocks_stream_round_robin_over_the_prefill_ranks(p_tp, d_tp, first_block):
    num_blocks = 5  # the prompt's blocks; the decode side holds the first `first_block`
    fabric = LocalFabric()
    # Rank r's copy of the latent: the same values, offset by 1000 * r (who wrote it).
    base = torch.randn(8, LAYERS, 1, 1, BS, ROW)
    prefill = [
        latent_conn(fabric, f"p{r}", (base + 1000 * r).contiguous(), r, p_tp) for r in range(p_tp)
    ]
    decode = [
        latent_conn(fabric, f"d{r}", torch.zeros(8, LAYERS, 1, 1, BS, ROW), r, d_tp)
        for r in range(d_tp)
    ]
    src_blocks = [1, 2, 5, 6, 7]  # the prompt's blocks on the prefill ranks
    dst_blocks = [3, 4, 0, 1, 6][first_block:]  # the reserved ones, from first_block on
    try:
        for a in prefill + decode:
            for b in prefill + decode:
                if a is not b and (a in prefill) != (b in prefill):
                    a.add_peer(b.metadata())
        names = [p.agent_name for p in prefill]
        waits = [d.expect_stream("r", dst_blocks, names, first_block=first_block) for d in decode]
        reservations = [reservation for reservation, _ in waits]
        sent = [p.open_stream("r", reservations) for p in prefill]
        for p in prefill:  # two chunks, one layer per write
            groups = layer_groups(LAYERS, 1)
            for k, (first, n) in enumerate([(0, 2), (2, 3)]):
                for i, layers in enumerate(groups):
                    is_last = k == 1 and i == len(groups) - 1
                    ids = src_blocks[first : first + n]
                    p.write_layers("r", first, ids, layers, layers[1], is_last)
        block_bytes = decode[0].layout.block_bytes
        for _, future in waits:
            assert future.result(5).num_bytes == len(dst_blocks) * block_bytes
        written = [f.result(5) for f in sent]
        num_received = num_blocks - first_block
        assert sum(written) == d_tp * num_received * block_bytes  # each block once per reader
        for r, conn in enumerate(decode):
            got = conn._backend.memory.view(torch.float32).view(8, LAYERS, 1, 1, BS, ROW)
            plan = latent_block_sources(first_block, num_received, range(p_tp), r)
            for src_rank, positions in plan.items():
                for pos in positions:
                    want = base[src_blocks[first_block + pos]] + 1000 * src_rank
                    assert torch.equal(got[dst_blocks[pos]], want), (r, src_rank, pos)
            untouched = [b for b in range(8) if b not in dst_blocks]
            assert not got[untouched].any()
            assert conn.stats().num_streams == 0
        for p in prefill:
            assert p.stats().num_streams == 0
    finally:
        for c in prefill + decode:
            c.close()
