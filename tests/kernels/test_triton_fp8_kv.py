"""The Triton ops over an FP8 KV cache (kernels/fp8_kv.py) against the references.

store_kv: bit for bit the reference's packed rows (values and scales). Attention (decode with
and without splits, the mixed decode + extend batch): the reference over the dequantized
cache. Unowned slots hold 0xFF bytes (an FP8 NaN with a NaN scale): the kernels mask loads
past a context, so a stray read shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_testing import DEVICE, bf16_dots_in_interpreter, require_triton

require_triton()

from kernels.fp8_kv import dequantize_rows, quantize_rows  # noqa: E402
from kernels.kv_store import store_kv as reference_store_kv  # noqa: E402
from kernels.paged_attention import paged_attention as reference_attention  # noqa: E402
from kernels.triton_attention import paged_attention  # noqa: E402
from kernels.triton_kv_store import store_kv  # noqa: E402
from kernels.triton_paged_decode import paged_decode_attention  # noqa: E402
from tests.kernels.paged_batch import build_metadata, random_block_tables  # noqa: E402

NUM_LAYERS, LAYER = 2, 1


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype", "static"),
    [
        (16, 3, 80, torch.float32, False),
        (5, 1, 20, torch.bfloat16, False),  # odd block size, a tiny head dim, bfloat16 input
        (16, 2, 64, torch.float32, True),  # a checkpoint's static scales, some values saturate
        (16, 2, 64, torch.float32, "k"),  # a static K scale only
    ],
)
def test_store_kv_writes_the_reference_rows_bit_for_bit(
    block_size, num_kv_heads, head_dim, dtype, static
):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks, row = 7, head_dim + 4
    shape = (num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, row)
    kv_cache = torch.full(shape, 0xFF, dtype=torch.uint8, device=DEVICE)
    num_tokens = 2 * block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1  # padding token: skipped
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen) * 4
    qkv = qkv.to(dtype).to(DEVICE)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim]
    value = qkv[:, 2 * num_kv_heads * head_dim :]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    scales = {"k_scale": 0.01, "v_scale": 0.02} if static else {}
    if static == "k":
        scales = {"k_scale": 0.01}

    expected = kv_cache.clone()
    reference_store_kv(key, value, expected[:, LAYER], slots.to(DEVICE), **scales)
    store_kv(key, value, kv_cache[:, LAYER], slots.to(DEVICE), **scales)
    assert torch.equal(kv_cache, expected)
    assert int((kv_cache != 0xFF).any(-1).sum()) == 2 * (num_tokens - 1) * num_kv_heads


class Fp8Case:
    """A paged batch over an FP8 cache (the strided layer view) and its dequantized twin."""

    def __init__(self, query_lens, seq_lens, num_decodes, num_heads, num_kv_heads, head_dim,
                 block_size, dtype=torch.float32, shared_prefix_lens=None, seed=0):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
        tables = random_block_tables(seq_lens, block_size, num_blocks, gen, shared_prefix_lens)
        shape = (num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, head_dim + 4)
        cache = torch.full(shape, 0xFF, dtype=torch.uint8)
        finite = torch.zeros(shape, dtype=torch.uint8)  # the reference wants finite slots
        for seq_len, table in zip(seq_lens, tables, strict=True):
            for pos in range(seq_len):
                block, offset = table[pos // block_size], pos % block_size
                values = torch.randn(2, num_kv_heads, head_dim, generator=gen)
                values *= 0.25 + torch.rand(
                    2, num_kv_heads, 1, generator=gen
                )  # rows differ in scale
                rows = quantize_rows(values.to(dtype))
                cache[block, LAYER, :, :, offset] = finite[block, LAYER, :, :, offset] = rows
        self.layer = cache.to(DEVICE)[:, LAYER]
        self.dequantized = dequantize_rows(finite[:, LAYER], torch.float32).to(DEVICE)
        num_tokens = sum(query_lens)
        self.query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.query = self.query.to(DEVICE)
        self.metadata = build_metadata(
            query_lens, seq_lens, tables, block_size, num_decodes, device=DEVICE
        )

    def reference(self, scale):
        """In float32, cast to the query's dtype at the end."""
        out = reference_attention(self.query.float(), self.dequantized, self.metadata, scale)
        return out.to(self.query.dtype)


@pytest.mark.parametrize(
    ("num_kv_heads", "ratio", "head_dim", "block_size"), [(2, 4, 80, 16), (3, 1, 64, 32)]
)
def test_mixed_batch_and_split_decodes_match_the_dequantized_reference(
    num_kv_heads, ratio, head_dim, block_size
):
    decode_lens = [2 * block_size + 7, block_size, 3]
    extends = [(37, 0), (21, block_size + 5), (19, 2 * block_size + 3)]
    query_lens = [1] * len(decode_lens) + [q for q, _ in extends]
    seq_lens = decode_lens + [q + cached for q, cached in extends]
    shared = [0] * len(seq_lens)
    shared[-1] = 2 * block_size  # a prefix-cache hit on sequence 0's FP8 blocks
    case = Fp8Case(query_lens, seq_lens, len(decode_lens), num_kv_heads * ratio, num_kv_heads,
                   head_dim, block_size, shared_prefix_lens=shared, seed=head_dim)  # fmt: skip
    scale = head_dim**-0.5
    expected = case.reference(scale)
    layer_before = case.layer.clone()
    out = paged_attention(case.query, case.layer, case.metadata, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    md = case.metadata
    split = paged_decode_attention(
        case.query[:3], case.layer, md.block_tables[:3], md.seq_lens[:3], max(decode_lens),
        scale, num_splits=3, block_n=16,
    )  # fmt: skip
    torch.testing.assert_close(split, expected[:3], atol=2e-5, rtol=1e-5)
    assert torch.equal(case.layer, layer_before)  # read-only


def test_bfloat16_queries_over_fp8():
    case = Fp8Case([1, 1, 20], [70, 5, 20], 2, 8, 2, 96, 32, dtype=torch.bfloat16, seed=3)
    with bf16_dots_in_interpreter():
        out = paged_attention(case.query, case.layer, case.metadata, 96**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, case.reference(96**-0.5), atol=2e-2, rtol=2e-2)
