"""Pipeline stages on either side: every decode rank gets exactly its layers and heads.

Each rank of a TP x PP worker holds the heads of its TP position and the layers of its
stage (``layout.layer_range``: contiguous, the first stages take the extra layers). For
every decode rank, copying the planned segments from every prefill rank must rebuild
exactly its slice of the whole model's KV, each (layer, head) from one prefill rank, and
``num_readers`` must count, per prefill rank, the decode ranks that read from it.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtransfer.layout import KVLayout, kv_head_range, layer_range
from kvtransfer.tp_mapping import num_readers, plan_for_pair

from .helpers import MODEL, full_kv
from .test_tp_mapping import apply_segments

CASES = [  # (layers, kv heads, prefill (tp, pp), decode (tp, pp))
    (4, 4, (1, 2), (1, 1)),  # the case: prefill PP=2 -> decode TP=1
    (5, 4, (1, 2), (1, 1)),  # uneven split: 3 + 2
    (4, 4, (1, 1), (1, 2)),
    (5, 4, (2, 2), (1, 1)),
    (5, 4, (1, 3), (2, 2)),  # stages cut the layers at different places on each side
    (3, 2, (4, 3), (1, 2)),  # prefill replicates heads, one layer per stage
    (6, 2, (2, 2), (4, 3)),  # decode replicates heads
    (4, 4, (2, 2), (2, 2)),  # equal layouts: whole blocks
]


def test_layer_range_is_contiguous_and_gives_the_extra_layers_to_the_first_stages():
    assert [layer_range(5, s, 2) for s in range(2)] == [(0, 3), (3, 5)]
    assert [layer_range(7, s, 3) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [layer_range(3, s, 3) for s in range(3)] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="2 layers cannot fill 3"):
        layer_range(2, 0, 3)


def _rank(full: torch.Tensor, tp_rank: int, tp: int, stage: int, pp: int, num_blocks: int):
    """(cache, layout) of one rank: its stage's layers, its heads; zeros if num_blocks."""
    heads = full.shape[3]
    h0, h1 = kv_head_range(heads, tp_rank, tp)
    l0, l1 = layer_range(full.shape[1], stage, pp)
    part = full[:, l0:l1, :, h0:h1]
    if num_blocks:
        part = torch.zeros((num_blocks, *part.shape[1:]), dtype=full.dtype)
    cache = part.contiguous()
    layout = KVLayout.from_tensor(
        cache,
        model_id=MODEL,
        num_kv_heads=heads,
        tp_rank=tp_rank,
        tp_size=tp,
        first_layer=l0,
        total_num_layers=full.shape[1],
    )
    return cache, layout


@pytest.mark.parametrize(("layers", "heads", "src", "dst"), CASES)
def test_decode_ranks_reassemble_their_layers_and_heads(layers, heads, src, dst):
    (p_tp, p_pp), (d_tp, d_pp) = src, dst
    rng = random.Random(layers * 1000 + heads * 100 + p_tp * 10 + d_tp)
    full = full_kv(num_blocks=10, num_layers=layers, num_kv_heads=heads, seed=p_pp * 10 + d_pp)
    prefill = [_rank(full, t, p_tp, s, p_pp, 0) for s in range(p_pp) for t in range(p_tp)]
    src_ids = rng.sample(range(10), 4)
    readers = [0] * len(prefill)
    for stage in range(d_pp):
        for tp_rank in range(d_tp):
            dst, dst_layout = _rank(full, tp_rank, d_tp, stage, d_pp, num_blocks=7)
            dst_ids = rng.sample(range(7), 4)
            bytes_copied = 0
            for i, (src_cache, src_layout) in enumerate(prefill):
                segments = plan_for_pair(src_layout, dst_layout)
                readers[i] += bool(segments)
                bytes_copied += sum(seg.length for seg in segments)
                apply_segments(src_cache, dst, segments, src_ids, dst_ids)
            l0, l1 = dst_layout.layer_range
            h0, h1 = dst_layout.head_range
            assert torch.equal(dst[dst_ids], full[src_ids][:, l0:l1, :, h0:h1])
            # Each (layer, K/V, head) exactly once: no byte is copied twice.
            assert bytes_copied == dst_layout.block_bytes
    for i, (_, layout) in enumerate(prefill):
        expected = num_readers(
            heads,
            layout.tp_rank,
            p_tp,
            d_tp,
            src_layers=layout.layer_range,
            total_num_layers=layers,
            dst_pp_size=d_pp,
        )
        assert readers[i] == expected, f"prefill rank {i}"


def test_equal_stages_are_one_whole_block_segment():
    full = full_kv(num_blocks=4, num_layers=4, num_kv_heads=4)
    _, src_layout = _rank(full, 1, 2, 1, 2, 0)
    _, dst_layout = _rank(full, 1, 2, 1, 2, num_blocks=4)
    (segment,) = plan_for_pair(src_layout, dst_layout)
    assert segment.length == src_layout.block_bytes and segment.src_offset == 0


def test_stages_of_one_model_are_compatible_and_of_another_are_not():
    full = full_kv(num_blocks=4, num_layers=4, num_kv_heads=4)
    _, first = _rank(full, 0, 1, 0, 2, 0)
    _, whole = _rank(full, 0, 1, 0, 1, 0)
    assert first.fingerprint == whole.fingerprint
    _, shorter = _rank(full[:, :3], 0, 1, 0, 1, 0)  # a 3-layer model
    assert shorter.fingerprint != whole.fingerprint
