"""The latent-cache reference (kernels/mla_attention.py): storing and gathering rows, and
the absorbed decode attention against its definition written out per sequence and head,
on ragged contexts, block sizes 16 and 32, one padded group and several."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import dequantize_rows, packed_row_bytes, quantize_rows
from kernels.mla_attention import (
    gather_latent,
    latent_layer,
    mla_decode_attention,
    mla_prefill_attention,
    store_latent,
)
from tests.kernels.paged_batch import build_metadata, random_block_tables


def naive_mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    tables: list[list[int]],
    seq_lens: list[int],
    scale: float,
    rank: int,
) -> torch.Tensor:
    """Per sequence: its rows in order; per head: softmax(q . rows) . rows[:, :rank]."""
    block_size = latent_cache.shape[1]
    out = []
    for s, seq_len in enumerate(seq_lens):
        rows = torch.stack(
            [latent_cache[tables[s][p // block_size], p % block_size] for p in range(seq_len)]
        ).double()
        probs = torch.softmax(q[s].double() @ rows.T * scale, dim=-1)  # [H, seq_len]
        out.append(probs @ rows[:, :rank])
    return torch.stack(out)


def latent_batch(seq_lens, block_size, num_heads, rank, rope, dtype, seed=0):
    """(q, latent_cache with garbage in unowned slots, block tables, metadata) of a batch of
    decodes."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, rank + rope, generator=gen).to(dtype)
    metadata = build_metadata([1] * len(seq_lens), seq_lens, tables, block_size, len(seq_lens))
    return q, cache, tables, metadata


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("num_heads", "rank", "rope"), [(4, 32, 8), (16, 64, 16), (3, 40, 24)]
)  # fmt: skip
def test_decode_matches_definition(block_size, num_heads, rank, rope):
    seq_lens = [1, 7, 16, 33, 100, 5]
    q, cache, tables, metadata = latent_batch(
        seq_lens, block_size, num_heads, rank, rope, torch.float32
    )
    got = mla_decode_attention(q, cache, metadata, 0.3, rank)
    want = naive_mla_decode(q, cache, tables, seq_lens, 0.3, rank)
    assert got.shape == (len(seq_lens), num_heads, rank)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_in_several_groups():
    """Contexts far apart in length are padded in separate groups (metadata.decode_groups);
    the result is the same as the definition."""
    seq_lens = [2500, 3, 2600, 40, 1]
    q, cache, tables, metadata = latent_batch(seq_lens, 16, 2, 512, 64, torch.float32, seed=1)
    groups = metadata.decode_groups((4 << 20) // (576 * 4), (4 << 20) // (576 * 4))
    assert len(groups) > 1
    got = mla_decode_attention(q, cache, metadata, 0.05, 512)
    want = naive_mla_decode(q, cache, tables, seq_lens, 0.05, 512)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_definition(block_size):
    """Each query of a chunk equals a decode whose context ends at its own position (the
    causal, bottom-right aligned mask), written out per position; decodes come first in
    the batch and are not the prefill's."""
    query_lens, seq_lens = [1, 19, 7, 1], [12, 19, 40, 21]
    gen = torch.Generator().manual_seed(3)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    cache = torch.randn(num_blocks, block_size, 40, generator=gen)
    q = torch.randn(sum(query_lens[1:]), 3, 40, generator=gen)
    metadata = build_metadata(query_lens, seq_lens, tables, block_size, 1)
    got = mla_prefill_attention(q, cache, metadata, 0.3, 32)
    want, row = [], 0
    for seq_idx in range(1, len(seq_lens)):
        for i in range(query_lens[seq_idx]):
            ctx = seq_lens[seq_idx] - query_lens[seq_idx] + i + 1
            want.append(
                naive_mla_decode(q[row : row + 1], cache, [tables[seq_idx]], [ctx], 0.3, 32)
            )
            row += 1
    assert got.shape == (q.shape[0], 3, 32)
    torch.testing.assert_close(got.double(), torch.cat(want), atol=1e-5, rtol=1e-5)


def test_store_and_gather_rows():
    kv_cache = torch.zeros(6, 3, 1, 1, 4, 10)
    layer = latent_layer(kv_cache, 2)
    assert layer.shape == (6, 4, 10) and layer.data_ptr() == kv_cache[0, 2].data_ptr()
    rows = torch.arange(50.0).view(5, 10)
    store_latent(rows, layer, torch.tensor([9, 8, -1, 20, 0]))  # -1: not stored
    assert torch.equal(layer[2, 1], rows[0]) and torch.equal(layer[2, 0], rows[1])
    assert torch.equal(layer[5, 0], rows[3]) and torch.equal(layer[0, 0], rows[4])
    assert int((kv_cache != 0).any(dim=-1).sum()) == 4  # nothing else, no other layer
    got = gather_latent(layer, torch.tensor([2, 0, 5], dtype=torch.int32), 9, torch.float32)
    assert torch.equal(got[:2], torch.stack([rows[1], rows[0]])) and got.shape == (9, 10)
    assert torch.equal(got[8], rows[3])


def test_latent_layer_refuses_other_layouts():
    with pytest.raises(ValueError, match="latent cache"):
        latent_layer(torch.zeros(4, 2, 2, 1, 8, 16), 0)  # a K/V cache
    with pytest.raises(ValueError, match="float or packed FP8"):
        latent_layer(torch.zeros(4, 2, 1, 1, 8, 16, dtype=torch.int32), 0)


def fp8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float latent cache [num_blocks, block_size, row] as packed FP8 rows (uint8)."""
    return quantize_rows(cache)


def test_fp8_rows_store_gather_and_decode_as_their_dequantized_values():
    """FP8 latent rows (one scale per row, kernels/fp8_kv.py's bytes): stored by
    quantizing, gathered and attended as exactly their dequantized values."""
    kv_cache = torch.zeros(6, 3, 1, 1, 4, packed_row_bytes(12), dtype=torch.uint8)
    layer = latent_layer(kv_cache, 1)
    rows = torch.randn(5, 12, generator=torch.Generator().manual_seed(3)) * 7
    store_latent(rows, layer, torch.tensor([9, 8, -1, 20, 0]))
    assert torch.equal(layer[2, 1], quantize_rows(rows[0]))  # the reference's bytes
    assert int((kv_cache != 0).any(dim=-1).sum()) == 4
    got = gather_latent(layer, torch.tensor([2, 0, 5], dtype=torch.int32), 9, torch.float32)
    assert torch.equal(got[0], dequantize_rows(quantize_rows(rows[1]), torch.float32))
    torch.testing.assert_close(got[8], rows[3], rtol=0.07, atol=0.0)  # e4m3: 3 mantissa bits

    seq_lens = [1, 7, 33, 100, 5]
    q, cache, tables, metadata = latent_batch(seq_lens, 16, 4, 32, 8, torch.float32, seed=2)
    packed = fp8_cache(cache)
    got = mla_decode_attention(q, packed, metadata, 0.3, 32)
    dequantized = dequantize_rows(packed, torch.float32)
    torch.testing.assert_close(got, mla_decode_attention(q, dequantized, metadata, 0.3, 32))
    want = naive_mla_decode(q, dequantized, tables, seq_lens, 0.3, 32)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
