"""Triton MLA prefill (kernels/triton_mla_prefill.py) against the latent-cache reference,
on the strided layer view of a whole latent cache whose unowned slots are NaN (a stray read
shows up): decodes first in the batch (their rows are skipped), a whole prompt, chunks on a
cached prefix, a one-token extend, heads that do not divide the tile (a tile's rows span
tokens), R and P not powers of two, block sizes 16 and 32, float32, bfloat16 and FP8 rows."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_testing import (
    DEVICE,
    bf16_dots_in_interpreter,
    require_triton,
    rounding_tolerance,
)

require_triton()

from kernels.fp8_kv import quantize_rows  # noqa: E402
from kernels.mla_attention import latent_layer, mla_prefill_attention  # noqa: E402
from kernels.triton_mla_prefill import mla_prefill_attention as triton_mla_prefill  # noqa: E402
from tests.kernels.paged_batch import build_metadata, random_block_tables  # noqa: E402

NUM_LAYERS, LAYER = 3, 1
# Two decodes, then: a whole 19-token prompt, 7 tokens on a 33-token prefix, one token on 20.
QUERY_LENS, SEQ_LENS = [1, 1, 19, 7, 1], [12, 30, 19, 40, 21]


def _case(block_size, num_heads, rank, rope, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in SEQ_LENS) + 3
    tables = random_block_tables(SEQ_LENS, block_size, num_blocks, gen)
    row = rank + rope
    kv_cache = torch.full((num_blocks, NUM_LAYERS, 1, 1, block_size, row), float("nan"))
    layer = latent_layer(kv_cache, LAYER)
    for table, seq_len in zip(tables, SEQ_LENS, strict=True):
        for p in range(seq_len):
            layer[table[p // block_size], p % block_size] = torch.randn(row, generator=gen)
    q = torch.randn(sum(QUERY_LENS[2:]), num_heads, row, generator=gen)
    kv_cache, q = kv_cache.to(dtype), q.to(dtype)
    finite = latent_layer(torch.nan_to_num(kv_cache, nan=3.0e4), LAYER)
    args = (QUERY_LENS, SEQ_LENS, tables, block_size, 2)
    on_device = build_metadata(*args, device=DEVICE)
    return q, latent_layer(kv_cache, LAYER), finite, build_metadata(*args), on_device


@pytest.mark.parametrize(
    ("block_size", "num_heads", "rank", "rope", "block_m"),
    [(16, 4, 32, 8, 16), (32, 5, 40, 24, 16), (16, 3, 64, 16, 32)],
)
def test_matches_reference_float32(block_size, num_heads, rank, rope, block_m):
    q, cache, finite, metadata, on_device = _case(
        block_size, num_heads, rank, rope, torch.float32, seed=rank
    )
    want = mla_prefill_attention(q, finite, metadata, 0.2, rank)
    got = triton_mla_prefill(
        q.to(DEVICE), cache.to(DEVICE), on_device, 0.2, rank, block_m=block_m, block_n=16
    )
    assert got.shape == want.shape == (q.shape[0], num_heads, rank)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, **rounding_tolerance(torch.float32))


def test_matches_reference_bfloat16():
    q, cache, finite, metadata, on_device = _case(16, 8, 64, 16, torch.bfloat16, 4)
    want = mla_prefill_attention(q.float(), finite.float(), metadata, 0.1, 64)
    with bf16_dots_in_interpreter():
        got = triton_mla_prefill(q.to(DEVICE), cache.to(DEVICE), on_device, 0.1, 64, block_n=16)
    assert got.dtype == torch.bfloat16
    # Probabilities rounded to bfloat16 before the value product: a few ulps.
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=2e-2)


def test_fp8_cache_matches_the_reference_on_the_same_bytes():
    """Packed FP8 rows (one float32 scale per row): the kernel's result equals the
    reference over the same bytes (both read them as their dequantized values)."""
    q, _, finite, metadata, on_device = _case(16, 5, 40, 24, torch.float32, 9)
    packed = quantize_rows(finite * 0.01)  # spread over e4m3's range, NaN slots finite
    want = mla_prefill_attention(q, packed, metadata, 0.2, 40)
    got = triton_mla_prefill(
        q.to(DEVICE), packed.to(DEVICE), on_device, 0.2, 40, block_m=16, block_n=16
    )
    torch.testing.assert_close(got.cpu(), want, **rounding_tolerance(torch.float32))
