"""Triton MLA decode (kernels/triton_mla_decode.py) against the latent-cache reference, on
the strided layer view of a whole latent cache whose unowned slots are NaN (a stray read
shows up): ragged contexts over several tiles, heads not a multiple of 16, R and P not
powers of two, block sizes 16 and 32, with and without flash-decoding splits."""

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
from kernels.mla_attention import latent_layer, mla_decode_attention  # noqa: E402
from kernels.triton_mla_decode import mla_decode_attention as triton_mla_decode  # noqa: E402
from tests.kernels.paged_batch import build_metadata, random_block_tables  # noqa: E402

NUM_LAYERS, LAYER = 3, 1


def _case(seq_lens, block_size, num_heads, rank, rope, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    row = rank + rope
    kv_cache = torch.full((num_blocks, NUM_LAYERS, 1, 1, block_size, row), float("nan"))
    layer = latent_layer(kv_cache, LAYER)
    for table, seq_len in zip(tables, seq_lens, strict=True):
        for p in range(seq_len):
            layer[table[p // block_size], p % block_size] = torch.randn(row, generator=gen)
    q = torch.randn(len(seq_lens), num_heads, row, generator=gen)
    kv_cache, q = kv_cache.to(dtype), q.to(dtype)
    finite = latent_layer(torch.nan_to_num(kv_cache, nan=3.0e4), LAYER)
    args = ([1] * len(seq_lens), seq_lens, tables, block_size, len(seq_lens))
    on_device = build_metadata(*args, device=DEVICE)
    return q, latent_layer(kv_cache, LAYER), finite, build_metadata(*args), on_device


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    ("block_size", "num_heads", "rank", "rope"),
    [(16, 4, 32, 8), (32, 20, 40, 24), (16, 16, 64, 16)],
)
def test_matches_reference_float32(block_size, num_heads, rank, rope, num_splits):
    q, cache, finite, metadata, on_device = _case(
        [1, 17, 70, 33, 5], block_size, num_heads, rank, rope, torch.float32, seed=rank
    )
    want = mla_decode_attention(q, finite, metadata, 0.2, rank)
    got = triton_mla_decode(
        q.to(DEVICE), cache.to(DEVICE), on_device, 0.2, rank, num_splits=num_splits, block_n=16
    )
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, **rounding_tolerance(torch.float32))


def test_matches_reference_bfloat16():
    q, cache, finite, metadata, on_device = _case([9, 40, 2], 16, 8, 64, 16, torch.bfloat16, 4)
    want = mla_decode_attention(q.float(), finite.float(), metadata, 0.1, 64)
    with bf16_dots_in_interpreter():
        got = triton_mla_decode(q.to(DEVICE), cache.to(DEVICE), on_device, 0.1, 64, block_n=16)
    assert got.dtype == torch.bfloat16
    # Probabilities rounded to bfloat16 before the value product: a few ulps.
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache_matches_the_reference_on_the_same_bytes(num_splits):
    """Packed FP8 rows (one float32 scale per row): the kernel's result equals the
    reference over the same bytes (both read them as their dequantized values)."""
    q, _, finite, metadata, on_device = _case([1, 17, 70, 5], 16, 20, 40, 24, torch.float32, 9)
    packed = quantize_rows(finite * 0.01)  # spread over e4m3's range, NaN slots finite
    want = mla_decode_attention(q, packed, metadata, 0.2, 40)
    got = triton_mla_decode(
        q.to(DEVICE), packed.to(DEVICE), on_device, 0.2, 40, num_splits=num_splits, block_n=16
    )
    torch.testing.assert_close(got.cpu(), want, **rounding_tolerance(torch.float32))


def test_refuses_mismatched_inputs():
    q, cache, _, metadata, _ = _case([3, 4], 16, 2, 32, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="R \\+ P"):
        triton_mla_decode(q[..., :-1], cache, metadata, 0.1, 32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        triton_mla_decode(q, cache, metadata, 0.1, 40)
    with pytest.raises(ValueError, match="cache"):
        triton_mla_decode(q.double(), cache, metadata, 0.1, 32)
