"""Triton paged attention (decode, prefill/extend, and the two combined) against the reference.

The cache is the strided layer view of a whole block-major cache. Every slot no sequence owns
is NaN: the kernels mask loads past a context, so a stray read shows up as NaN. The
reference (which gathers whole blocks and relies on finite slots) runs on a copy with the
NaNs replaced by a huge finite value. Outputs are NaN-poisoned before each run.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.triton_testing import (
    DEVICE,
    bf16_dots_in_interpreter,
    require_triton,
    requires_cuda,
)

require_triton()

from kernels.paged_attention import paged_attention as reference_attention  # noqa: E402
from kernels.triton_attention import paged_attention  # noqa: E402
from kernels.triton_paged_decode import choose_num_splits, paged_decode_attention  # noqa: E402
from kernels.triton_prefill_attention import prefill_attention  # noqa: E402
from tests.kernels.paged_batch import build_metadata, random_block_tables  # noqa: E402

POISON = 3.0e4  # what the reference sees in unowned slots (finite, as its contract wants)
NUM_LAYERS, LAYER = 2, 1


class Case:
    """A paged batch: query, the NaN-poisoned layer view, its finite twin, the metadata."""

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_decodes: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        shared_prefix_lens: list[int] | None = None,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
        self.tables = random_block_tables(seq_lens, block_size, num_blocks, gen, shared_prefix_lens)
        shape = (num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, head_dim)
        cache = torch.full(shape, math.nan, dtype=dtype)
        for seq_len, table in zip(seq_lens, self.tables, strict=True):
            for pos in range(seq_len):
                block, offset = table[pos // block_size], pos % block_size
                values = torch.randn(2, num_kv_heads, head_dim, generator=gen)
                cache[block, LAYER, :, :, offset] = values.to(dtype)
        self.kv_cache = cache.to(DEVICE)
        self.layer = self.kv_cache[:, LAYER]  # strided, as in the engine
        self.finite_layer = self.layer.nan_to_num(nan=POISON)
        num_tokens = sum(query_lens)
        # A strided query: the q part of a fused qkv output, as the model hands it over.
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        qkv = qkv.to(dtype).to(DEVICE)
        self.query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        self.metadata = build_metadata(
            query_lens, seq_lens, self.tables, block_size, num_decodes, device=DEVICE
        )

    def reference(self, scale: float) -> torch.Tensor:
        if self.query.dtype == torch.float32:
            return reference_attention(self.query, self.finite_layer, self.metadata, scale)
        out = reference_attention(
            self.query.float(), self.finite_layer.float(), self.metadata, scale
        )
        return out.to(self.query.dtype)

    def poisoned_out(self) -> torch.Tensor:
        return torch.full_like(self.query, math.nan).contiguous()


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


# (num_kv_heads, gqa ratio): ratios 1, 4 and 7.
HEAD_CONFIGS = [(3, 1), (2, 4), (1, 7)]


@pytest.mark.parametrize("num_kv_heads,ratio", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(num_kv_heads, ratio, head_dim, block_size):
    # Ragged contexts: length 1, mid-block, exactly one block, several blocks ending mid-block.
    seq_lens = [1, block_size - 3, block_size, 3 * block_size + 5, 70]
    case = Case(
        [1] * len(seq_lens),
        seq_lens,
        len(seq_lens),
        num_kv_heads * ratio,
        num_kv_heads,
        head_dim,
        block_size,
        seed=head_dim + block_size + ratio,
    )
    scale = head_dim**-0.5
    expected = case.reference(scale)
    md = case.metadata
    for num_splits in (1, 3):  # one pass, and flash-decoding with its reduction
        out = case.poisoned_out()
        result = paged_decode_attention(
            case.query,
            case.layer,
            md.block_tables,
            md.seq_lens,
            md.max_seq_len,
            scale,
            out=out,
            num_splits=num_splits,
            block_n=16,
        )
        assert result is out
        torch.testing.assert_close(out, expected, **tolerances(out.dtype))


@pytest.mark.parametrize("num_kv_heads,ratio", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(num_kv_heads, ratio, head_dim, block_size):
    """Decodes and extends in one batch through the combined op: a fresh prompt, a chunk
    after a cached prefix that ends mid-block, a chunk on reused blocks (prefix hit), and a
    one-token extend."""
    decode_lens = [2 * block_size + 7, 2 * block_size, 3]
    shared_len = 2 * block_size
    extends = [(37, 0), (21, block_size + 5), (19, shared_len + 3), (1, 9)]
    query_lens = [1] * len(decode_lens) + [q for q, _ in extends]
    seq_lens = decode_lens + [q + cached for q, cached in extends]
    shared = [0] * len(seq_lens)
    shared[len(decode_lens) + 2] = shared_len
    case = Case(
        query_lens,
        seq_lens,
        len(decode_lens),
        num_kv_heads * ratio,
        num_kv_heads,
        head_dim,
        block_size,
        shared_prefix_lens=shared,
        seed=7 * head_dim + block_size + ratio,
    )
    assert case.tables[len(decode_lens) + 2][:2] == case.tables[0][:2]  # reused blocks
    scale = head_dim**-0.5
    cache_before = case.kv_cache.clone()
    out = paged_attention(case.query, case.layer, case.metadata, scale, out=case.poisoned_out())
    torch.testing.assert_close(out, case.reference(scale), **tolerances(out.dtype))
    torch.testing.assert_close(case.kv_cache, cache_before, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_prefill_tiles_cross_the_diagonal_everywhere(block_m, block_n):
    """Query tiles and key tiles of different sizes, prefixes not a multiple of either: the
    unmasked/masked split of the key loop lands at every offset."""
    query_lens = [45, 16, 33, 1]
    seq_lens = [45, 16 + 13, 33 + 40, 2]
    case = Case(query_lens, seq_lens, 0, 4, 2, 80, 16, seed=11)
    md = case.metadata
    out = prefill_attention(
        case.query,
        case.layer,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        md.max_query_len,
        0.1,
        out=case.poisoned_out(),
        block_m=block_m,
        block_n=block_n,
    )
    torch.testing.assert_close(out, case.reference(0.1), **tolerances(out.dtype))


def test_block_size_need_not_be_a_power_of_two():
    """Positions are looked up one by one, so a 24-slot block works like any other."""
    query_lens, seq_lens = [1, 1, 1, 30, 9], [24, 25, 71, 30, 9 + 47]
    case = Case(query_lens, seq_lens, 3, 8, 2, 64, 24, seed=13)
    out = paged_attention(case.query, case.layer, case.metadata, 0.125, out=case.poisoned_out())
    torch.testing.assert_close(out, case.reference(0.125), **tolerances(out.dtype))


def test_extend_rows_only_are_written():
    """The prefill kernel writes exactly the rows of the sequences it is given."""
    case = Case([1, 1, 9, 5], [10, 4, 30, 5], 2, 4, 1, 64, 16, seed=5)
    md = case.metadata
    out = case.poisoned_out()
    prefill_attention(
        case.query,
        case.layer,
        md.block_tables[2:],
        md.seq_lens[2:],
        md.query_start_loc[2:],
        9,
        0.125,
        out=out,
    )
    assert out[:2].isnan().all()
    torch.testing.assert_close(out[2:], case.reference(0.125)[2:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    """The production dtypes: a mixed batch, then its decodes again through the split path
    (float32 partials and log-sum-exps, cast to the cache dtype at the end)."""
    query_lens, seq_lens = [1, 1, 20, 7], [70, 5, 20, 40]
    case = Case(query_lens, seq_lens, 2, 8, 2, 96, 32, dtype=dtype, seed=3)
    scale = 96**-0.5
    expected = case.reference(scale)
    md = case.metadata
    with bf16_dots_in_interpreter():
        out = paged_attention(case.query, case.layer, md, scale, out=case.poisoned_out())
        split_out = paged_decode_attention(
            case.query[:2],
            case.layer,
            md.block_tables[:2],
            md.seq_lens[:2],
            70,
            scale,
            num_splits=3,
            block_n=16,
        )
    assert out.dtype == split_out.dtype == dtype
    torch.testing.assert_close(out, expected, **tolerances(dtype))
    torch.testing.assert_close(split_out, expected[:2], **tolerances(dtype))


def test_rejects_bad_inputs():
    case = Case([1], [5], 1, 4, 2, 64, 16)
    md = case.metadata
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(case.query, case.layer, md.block_tables.long(), md.seq_lens, 5, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(case.query[:, :3], case.layer, md.block_tables, md.seq_lens, 5, 1.0)


def test_split_count_fills_the_gpu_without_tiny_ranges():
    num_sms = 132  # H100 / H200
    assert choose_num_splits(256, 8, 1024, num_sms) == 1  # plenty of programs already
    assert choose_num_splits(64, 8, 4096, num_sms) == 3  # batch 64 x 4k: ~3 waves more
    assert choose_num_splits(8, 8, 32768, num_sms) == 17  # few long requests: split wide
    assert choose_num_splits(1, 8, 300, num_sms) == 2  # never ranges under 256 tokens
    assert choose_num_splits(1, 1, 1 << 20, num_sms) == 64  # capped


@pytest.mark.slow
def test_long_context_decode_with_splits():
    """Contexts of different lengths split into many ranges (some empty for short ones)."""
    seq_lens = [1000, 7, 513, 64]
    case = Case([1] * 4, seq_lens, 4, 8, 1, 128, 32, seed=9)
    md = case.metadata
    expected = case.reference(0.09)
    out = paged_decode_attention(
        case.query,
        case.layer,
        md.block_tables,
        md.seq_lens,
        md.max_seq_len,
        0.09,
        out=case.poisoned_out(),
        num_splits=8,
    )
    torch.testing.assert_close(out, expected, **tolerances(out.dtype))


class LargeCase(Case):
    """Like ``Case``, but fills the cache with whole-tensor ops (contexts up to 32k)."""

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_decodes: int,
        block_size: int,
        dtype: torch.dtype,
        num_heads: int = 32,
        num_kv_heads: int = 8,
        head_dim: int = 128,
    ) -> None:
        gen = torch.Generator().manual_seed(block_size)
        num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
        self.tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
        shape = (num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, head_dim)
        cache = torch.randn(shape, generator=gen).to(dtype)
        is_owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for seq_len, table in zip(seq_lens, self.tables, strict=True):
            ids = torch.tensor(table)
            is_owned[ids] = True
            if seq_len % block_size:
                is_owned[ids[-1], seq_len % block_size :] = False
        cache[:, LAYER].masked_fill_(~is_owned[:, None, None, :, None], math.nan)
        self.kv_cache = cache.to(DEVICE)
        self.layer = self.kv_cache[:, LAYER]
        self.finite_layer = self.layer.nan_to_num(nan=POISON)
        query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
        self.query = query.to(dtype).to(DEVICE)
        self.metadata = build_metadata(
            query_lens, seq_lens, self.tables, block_size, num_decodes, device=DEVICE
        )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_shapes_compiled(block_size, dtype):
    """Contexts from 1 to 32k in one decode batch (GQA 4, head_dim 128, automatic split
    count); then a 4k-token prefill after a 1k cached prefix beside a short prompt."""
    scale = 128**-0.5
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = [
        1,
        17,
        4096,
        32768,
        300,
        8191,
        *torch.randint(1, 2048, (10,), generator=gen).tolist(),
    ]
    case = LargeCase([1] * len(seq_lens), seq_lens, len(seq_lens), block_size, dtype)
    out = paged_attention(case.query, case.layer, case.metadata, scale, out=case.poisoned_out())
    torch.testing.assert_close(out, case.reference(scale), **tolerances(dtype))
    case = LargeCase([4096, 40], [5120, 40], 0, block_size, dtype)
    out = paged_attention(case.query, case.layer, case.metadata, scale, out=case.poisoned_out())
    torch.testing.assert_close(out, case.reference(scale), **tolerances(dtype))
