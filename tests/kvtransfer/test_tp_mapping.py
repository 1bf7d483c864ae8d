"""Heterogeneous TP: every decode rank reassembles exactly its heads from the prefill ranks."""

from __future__ import annotations

import random

import pytest
import torch

from kvtransfer.layout import kv_head_range
from kvtransfer.tp_mapping import (
    Segment,
    count_merged_descriptors,
    num_readers,
    plan_for_pair,
    source_heads,
)

from .helpers import empty_cache, full_kv, layout_of, rank_cache

CASES = [  # (num_kv_heads, prefill tp, decode tp)
    (4, 1, 1),
    (4, 2, 1),
    (4, 1, 2),
    (8, 2, 4),
    (8, 4, 2),
    (2, 4, 1),  # prefill replicates heads
    (2, 1, 4),  # decode replicates heads
    (2, 4, 8),
    (4, 2, 8),
]


def apply_segments(src, dst, segments, src_ids, dst_ids):
    """What a transfer does, with the byte ranges the plan gives."""
    src_bytes = src.reshape(-1).view(torch.uint8)
    dst_bytes = dst.reshape(-1).view(torch.uint8)
    src_stride = src[0].numel() * src.element_size()
    dst_stride = dst[0].numel() * dst.element_size()
    for s_block, d_block in zip(src_ids, dst_ids, strict=True):
        for seg in segments:
            s = s_block * src_stride + seg.src_offset
            d = d_block * dst_stride + seg.dst_offset
            dst_bytes[d : d + seg.length].copy_(src_bytes[s : s + seg.length])


@pytest.mark.parametrize(("heads", "p", "d"), CASES)
def test_decode_ranks_reassemble_their_heads(heads, p, d):
    rng = random.Random(heads * 100 + p * 10 + d)
    full = full_kv(num_blocks=12, num_kv_heads=heads, num_layers=3, seed=p * 10 + d)
    src_caches = [rank_cache(full, r, p) for r in range(p)]
    src_layouts = [layout_of(c, heads, r, p) for r, c in enumerate(src_caches)]
    src_ids = rng.sample(range(12), 5)
    for d_rank in range(d):
        dst = empty_cache(full, d_rank, d, num_blocks=9)
        dst_layout = layout_of(dst, heads, d_rank, d)
        dst_ids = rng.sample(range(9), 5)
        plan = source_heads(heads, p, d_rank, d)
        covered = []
        for s_rank, (src, src_layout) in enumerate(zip(src_caches, src_layouts, strict=True)):
            segments = plan_for_pair(src_layout, dst_layout)
            assert bool(segments) == (s_rank in plan)
            covered += plan.get(s_rank, ())
            apply_segments(src, dst, segments, src_ids, dst_ids)
        start, end = kv_head_range(heads, d_rank, d)
        assert sorted(covered) == list(range(start, end))  # each head from exactly one rank
        assert torch.equal(dst[dst_ids], full[src_ids][:, :, :, start:end])


@pytest.mark.parametrize(("heads", "p", "d"), CASES)
def test_num_readers_counts_every_reader_once(heads, p, d):
    readers = [num_readers(heads, r, p, d) for r in range(p)]
    pairs = sum(len(source_heads(heads, p, dr, d)) for dr in range(d))
    assert sum(readers) == pairs
    if p <= heads and d <= heads:
        assert all(n >= 1 for n in readers)


def test_equal_slices_are_one_segment_and_runs_merge():
    full = full_kv(num_blocks=8, num_kv_heads=4)
    a = layout_of(rank_cache(full, 1, 2), 4, 1, 2)
    b = layout_of(empty_cache(full, 1, 2, 8), 4, 1, 2)
    segments = plan_for_pair(a, b)
    assert segments == (Segment(0, 0, a.block_bytes),)
    stride = a.block_stride
    assert count_merged_descriptors([0, 1, 2, 5], [3, 4, 5, 7], segments, stride, stride) == 2
    assert count_merged_descriptors([4, 2, 7], [1, 2, 3], segments, stride, stride) == 3
    # TP=1 -> TP=2: per block one segment per (layer, K/V), nothing merges across blocks
    whole = layout_of(full, 4)
    half = layout_of(empty_cache(full, 0, 2, 8), 4, 0, 2)
    split = plan_for_pair(whole, half)
    assert len(split) == whole.num_layers * 2
    assert all(s.length == 2 * whole.head_bytes for s in split)
    assert count_merged_descriptors(
        [0, 1], [0, 1], split, whole.block_stride, half.block_stride
    ) == 2 * len(split)
