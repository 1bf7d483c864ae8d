"""paged_attention against dense causal attention over contiguous K/V, written plainly."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from kernels.paged_attention import paged_attention
from tests.kernels.paged_batch import build_metadata, random_block_tables

# Finite (the cache's contract) yet huge: an unmasked read of an unowned slot is obvious.
# Below float16's maximum, so the poison itself stays finite in every dtype we test.
POISON = 3.0e4
# The module (``kernels`` exports the function under the same name).
paged_attention_module = importlib.import_module("kernels.paged_attention")


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [q_len, Hq, D] at the last q_len positions of a context k, v [ctx_len, Hkv, D]."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for h in range(num_heads):
        scores = (q[:, h] @ k[:, h // group].T) * scale  # [q_len, ctx_len]
        for i in range(q_len):
            scores[i, ctx_len - q_len + i + 1 :] = -math.inf
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def make_case(
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
):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 7
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen, shared_prefix_lens)
    # Poison: every slot no sequence owns holds a huge finite value, so reading one
    # unmasked shows up (the cache contract: slots are finite, masked ones weigh zero).
    cache = torch.full((num_blocks, 2, num_kv_heads, block_size, head_dim), POISON, dtype=dtype)
    for seq_len, table in zip(seq_lens, tables, strict=True):
        for pos in range(seq_len):
            block, offset = table[pos // block_size], pos % block_size
            cache[block, :, :, offset] = torch.randn(2, num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    metadata = build_metadata(query_lens, seq_lens, tables, block_size, num_decodes)
    return query, cache, tables, metadata


def dense_reference(query, cache, tables, query_lens, seq_lens, scale):
    block_size = cache.shape[3]
    outputs, start = [], 0
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        slots = [(table[p // block_size], p % block_size) for p in range(seq_len)]
        k = torch.stack([cache[b, 0, :, o] for b, o in slots]).float()  # [ctx_len, Hkv, D]
        v = torch.stack([cache[b, 1, :, o] for b, o in slots]).float()
        outputs.append(naive_attention(query[start : start + q_len].float(), k, v, scale))
        start += q_len
    return torch.cat(outputs)


# (num_kv_heads, gqa ratio): ratios 1, 4 and 7.
HEAD_CONFIGS = [(3, 1), (2, 4), (1, 7)]


@pytest.mark.parametrize("num_kv_heads,ratio", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_decodes_and_extends(num_kv_heads, ratio, head_dim, block_size):
    seed = num_kv_heads * 1000 + head_dim + block_size
    rng = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=rng))

    # Decodes (contexts ragged, some ending mid-block, one exactly on a block boundary),
    # then: a fresh prompt, a chunk after a cached prefix ending mid-block, a chunk that
    # reuses sequence 0's first blocks (prefix-cache hit), and a one-token extend.
    decode_lens = [rand(1, 3 * block_size), 2 * block_size, rand(1, 5)]
    prefix = rand(block_size + 1, 3 * block_size)
    shared_len = 2 * block_size
    extends = [(rand(2, 40), 0), (rand(2, 40), prefix), (rand(2, 20), shared_len + 3), (1, 9)]
    query_lens = [1] * len(decode_lens) + [q for q, _ in extends]
    seq_lens = decode_lens + [q + cached for q, cached in extends]
    seq_lens[0] = max(seq_lens[0], shared_len)  # sequence 0 owns the shared blocks
    shared = [0] * len(seq_lens)
    shared[len(decode_lens) + 2] = shared_len

    num_heads = num_kv_heads * ratio
    query, cache, tables, metadata = make_case(
        query_lens,
        seq_lens,
        len(decode_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        shared_prefix_lens=shared,
        seed=seed,
    )
    assert tables[len(decode_lens) + 2][:2] == tables[0][:2]
    scale = head_dim**-0.5
    cache_before = cache.clone()
    out = paged_attention(query, cache, metadata, scale)
    expected = dense_reference(query, cache, tables, query_lens, seq_lens, scale)
    assert out.shape == query.shape
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert torch.equal(cache.nan_to_num(0), cache_before.nan_to_num(0))  # read-only


def test_decodes_only():
    query_lens, seq_lens = [1] * 5, [1, 17, 16, 33, 70]
    query, cache, tables, metadata = make_case(query_lens, seq_lens, 5, 8, 2, 64, 16, seed=1)
    out = paged_attention(query, cache, metadata, 0.125)
    torch.testing.assert_close(
        out, dense_reference(query, cache, tables, query_lens, seq_lens, 0.125)
    )


@pytest.mark.parametrize(
    ("cost_bytes", "max_bytes", "num_groups"),
    # 1 KiB per token: [130, 125 | 70, 61 | 9, 3, 2, 1] costs 100 tokens by length; with
    # at most 200 tokens a group, 130 and 125 are one row each.
    [(4 << 20, 8 << 20, 1), (100 << 10, 1 << 30, 3), (100 << 10, 200 << 10, 4)],
    ids=["one-group", "by-length", "by-length-and-size"],
)
def test_decodes_in_groups_by_context_length(monkeypatch, cost_bytes, max_bytes, num_groups):
    """Decodes of very different lengths, with extends after them: grouped (each group
    padded to its own longest) or not, the same attention as the dense reference."""
    monkeypatch.setattr(paged_attention_module, "_GROUP_COST_BYTES", cost_bytes)
    monkeypatch.setattr(paged_attention_module, "_GROUP_MAX_BYTES", max_bytes)
    decode_lens = [3, 130, 9, 61, 2, 125, 70, 1]
    query_lens = [1] * len(decode_lens) + [5, 12]
    seq_lens = [*decode_lens, 40, 12]
    query, cache, tables, metadata = make_case(
        query_lens, seq_lens, len(decode_lens), 8, 2, 64, 16, seed=5
    )
    out = paged_attention(query, cache, metadata, 0.125)
    torch.testing.assert_close(
        out, dense_reference(query, cache, tables, query_lens, seq_lens, 0.125)
    )
    token_bytes = 2 * 2 * 64 * 4  # K and V, 2 kv heads of 64, float32
    groups = metadata.decode_groups(cost_bytes // token_bytes, max_bytes // token_bytes)
    assert len(groups) == num_groups


def test_decode_groups_cover_every_decode_once_longest_first():
    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        lens = torch.randint(1, 3000, (n,), generator=gen).tolist()
        if trial % 5 == 0:
            lens = [lens[0]] * n  # all alike: one group, the batch in order
        cost, cap = int(torch.randint(1, 4000, (1,), generator=gen)), 6000
        metadata = build_metadata([1] * n, lens, [[0]] * n, 4096, n)
        groups = metadata.decode_groups(cost, cap)
        if len(set(lens)) == 1 and n * lens[0] <= cap:
            assert len(groups) == 1  # no padding to save, and within the cap
        if len(groups) == 1:
            assert groups[0].rows is None and groups[0].max_seq_len == max(lens)
            continue
        rows = [group.rows.tolist() for group in groups]
        assert sorted(r for group in rows for r in group) == list(range(n))
        maxima = [group.max_seq_len for group in groups]
        assert maxima == sorted(maxima, reverse=True)
        for group, members in zip(groups, rows, strict=True):
            assert group.num_rows == len(members)
            assert group.max_seq_len == max(lens[r] for r in members)
            assert group.num_rows == 1 or group.num_rows * group.max_seq_len <= cap


def test_extends_only_ragged_prompts():
    query_lens = seq_lens = [5, 1, 48, 17]
    query, cache, tables, metadata = make_case(query_lens, seq_lens, 0, 4, 4, 80, 16, seed=2)
    out = paged_attention(query, cache, metadata, 0.1)
    torch.testing.assert_close(
        out, dense_reference(query, cache, tables, query_lens, seq_lens, 0.1)
    )


def test_extends_run_through_the_fused_cpu_kernel():
    """Both extend cases (a whole prompt; a chunk on a cached prefix, GQA) reach torch's
    fused CPU attention: its unfused math path is 3x slower on long prompts."""
    query_lens, seq_lens = [40, 24], [40, 64]
    query, cache, tables, metadata = make_case(query_lens, seq_lens, 0, 8, 2, 64, 16, seed=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = paged_attention(query, cache, metadata, 0.125)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("aten::_scaled_dot_product_flash_attention_for_cpu") == 2, calls
    assert "aten::_scaled_dot_product_attention_math" not in calls
    torch.testing.assert_close(
        out, dense_reference(query, cache, tables, query_lens, seq_lens, 0.125)
    )


def test_bfloat16():
    query_lens, seq_lens = [1, 1, 20, 7], [30, 5, 20, 40]
    query, cache, tables, metadata = make_case(
        query_lens, seq_lens, 2, 8, 2, 128, 32, dtype=torch.bfloat16, seed=3
    )
    out = paged_attention(query, cache, metadata, 128**-0.5)
    assert out.dtype == torch.bfloat16
    expected = dense_reference(query, cache, tables, query_lens, seq_lens, 128**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
