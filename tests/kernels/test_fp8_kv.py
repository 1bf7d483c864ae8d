"""The FP8 KV-cache format (kernels/fp8_kv.py) and the reference ops over an FP8 cache:
each quantized op against the same op over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import FP8_MAX, dequantize_rows, quantize_rows
from kernels.kv_store import store_kv
from kernels.paged_attention import paged_attention
from tests.kernels.test_paged_attention import make_case


def test_rows_round_trip_within_fp8_precision_with_their_own_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[:, None]
    x[1, 2] = 0.0  # a row of zeros stays zeros (no 0/0)
    packed = quantize_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 68)
    scale = packed[..., 64:].contiguous().view(torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # Each row's own scale: its largest value lands on the largest finite FP8 value.
    torch.testing.assert_close(scale[amax > 0], (amax / FP8_MAX)[amax > 0])
    # The values, written plainly: round x / scale to e4m3 and back.
    expected = (x / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(dequantize_rows(packed, torch.float32), expected)
    assert torch.equal(dequantize_rows(packed, torch.float32)[1, 2], torch.zeros(64))
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of each value (normal range).
    normal = x.abs() > amax * 2**-6
    err = (dequantize_rows(packed, torch.float32) - x).abs()
    assert bool((err[normal] <= x.abs()[normal] * 2**-4).all())


def test_static_scale_saturates_instead_of_overflowing_to_nan():
    x = torch.tensor([[1.0, -2.0, 1000.0, -1000.0]])
    packed = quantize_rows(x, static_scale=0.5)
    out = dequantize_rows(packed, torch.float32)
    assert torch.equal(out, torch.tensor([[1.0, -2.0, FP8_MAX * 0.5, -FP8_MAX * 0.5]]))


def test_odd_head_dim_is_refused():
    with pytest.raises(ValueError, match="head_dim % 4"):
        quantize_rows(torch.ones(2, 66))


def test_store_kv_quantizes_each_token_row_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(1)
    num_blocks, heads, block_size, head_dim = 5, 3, 16, 80
    cache = torch.zeros(num_blocks, 2, heads, block_size, head_dim + 4, dtype=torch.uint8)
    key = torch.randn(7, heads, head_dim, generator=gen)
    value = torch.randn(7, heads, head_dim, generator=gen) * 50
    slots = torch.tensor([0, 17, 79, -1, 33, 34, 48])
    store_kv(key, value, cache, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert torch.equal(cache[block, 0, :, offset], quantize_rows(key[i]))
        assert torch.equal(cache[block, 1, :, offset], quantize_rows(value[i]))
    written = {divmod(s, block_size) for s in slots.tolist() if s >= 0}
    for block in range(num_blocks):
        for offset in range(block_size):
            if (block, offset) not in written:
                assert not cache[block, :, :, offset].any()


@pytest.mark.parametrize(("num_kv_heads", "ratio", "head_dim"), [(2, 4, 64), (3, 1, 80)])
def test_attention_over_fp8_cache_equals_attention_over_its_dequantized_copy(
    num_kv_heads, ratio, head_dim
):
    """Decodes (grouped), a fresh prompt and a chunk on a cached prefix over an FP8 cache:
    the same as the float32 reference over the dequantized cache."""
    query_lens = [1, 1, 1, 30, 9]
    seq_lens = [5, 40, 17, 30, 41]
    query, cache, _, metadata = make_case(
        query_lens, seq_lens, 3, num_kv_heads * ratio, num_kv_heads, head_dim, 16, seed=3
    )
    fp8_cache = quantize_rows(cache)
    out = paged_attention(query, fp8_cache, metadata, head_dim**-0.5)
    expected = paged_attention(
        query, dequantize_rows(fp8_cache, torch.float32), metadata, head_dim**-0.5
    )
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    # And FP8 is an approximation of the float cache, not something else.
    exact = paged_attention(query, cache, metadata, head_dim**-0.5)
    assert (out - exact).abs().max() < 0.25
