"""Batch-invariant linears and attention (kernels/batch_invariant.py), property-tested.

A row's bits must not depend on the rows beside it: for the linears, any sub-batch at any
offset (a lone row included) equals the whole batch's rows, at 1, 2 and 4 threads, float32
and bfloat16, oneDNN-packed and int4; for the attention, a sequence's query tokens come out
the same however the sequence is cut into chunks and whatever shares the batch, in float32,
bfloat16 and over an FP8 cache. The probe must catch a matmul that is not invariant.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kernels import cpu_linear, cpu_paged_decode, deterministic_kernel_ops, int4_linear
from kernels.batch_invariant import (
    MIN_ROWS,
    RowPadded,
    invariance_failures,
    per_token_attention,
    per_token_tables,
)
from kernels.fp8_kv import quantize_rows
from tests.kernels.paged_batch import build_metadata
from tests.kernels.test_paged_attention import dense_reference

DECODE = cpu_paged_decode.load()
# The model shapes of SmolLM2-135M (qkv, gate_up, down, LM head) and a tiny model's.
SHAPES = [(576, 960), (576, 3072), (1536, 576), (64, 192), (128, 344)]


def _packed(shape, dtype, seed=0):
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    return cpu_linear.pack(weight)


def _has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@functools.cache
def _onednn_invariant_here(shape, dtype) -> bool:
    """Whether this machine's oneDNN gives ``shape``'s rows the same bits at every row count
    (the probe the engine runs at load). float32: everywhere we have run. bfloat16: not on
    CPUs with AMX, where oneDNN picks its kernel by the number of rows (measured on an
    Intel Xeon with amx_bf16: SmolLM2's shapes differ at 1-31 rows); there
    ``model.deterministic`` refuses such a model at load, naming the layer."""
    failures = invariance_failures(
        RowPadded(cpu_linear.linear), _packed(shape, dtype), shape[0], dtype
    )
    return not failures


def test_the_op_set_is_the_cpp_kernels_with_per_token_attention():
    ops = deterministic_kernel_ops("cpu")
    assert ops.is_batch_invariant and ops.is_cpu_kernels
    assert ops.paged_attention.func is per_token_attention


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    num_rows=st.integers(1, 40),
    offset=st.integers(0, 20),
    threads=st.sampled_from([1, 2, 4]),
)
def test_padded_onednn_rows_equal_the_whole_batch(shape, dtype, num_rows, offset, threads):
    # Where the probe finds this machine's bfloat16 kernel row-dependent, the mode refuses
    # the model instead (test_the_probe_passes_the_kernels_the_mode_uses): nothing to hold.
    assume(_onednn_invariant_here(shape, dtype))
    packed = _packed(shape, dtype)
    matmul = RowPadded(cpu_linear.linear)
    x = torch.randn(64, shape[0], generator=torch.Generator().manual_seed(num_rows)).to(dtype)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            whole = matmul(x, packed)
            torch.set_num_threads(threads)
            part = matmul(x[offset : offset + num_rows].contiguous(), packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(part, whole[offset : offset + num_rows])


def test_a_lone_row_is_multiplied_beside_a_copy():
    seen = []

    def spy(x, weight, bias=None):
        seen.append(x.shape[0])
        return x @ weight.t()

    out = RowPadded(spy)(torch.ones(1, 4), torch.ones(3, 4))
    assert seen == [MIN_ROWS] and out.shape == (1, 3)
    out = RowPadded(spy)(torch.ones(4), torch.ones(3, 4))  # no batch dim: kept that way
    assert out.shape == (3,) and seen[-1] == MIN_ROWS
    RowPadded(spy)(torch.ones(5, 4), torch.ones(3, 4))
    assert seen[-1] == 5


def test_the_probe_passes_the_kernels_the_mode_uses():
    for shape in SHAPES:
        matmul = RowPadded(cpu_linear.linear)
        assert (
            invariance_failures(matmul, _packed(shape, torch.float32), shape[0], torch.float32)
            == []
        )
        # bfloat16: invariant everywhere but on AMX CPUs (see _onednn_invariant_here).
        assert _onednn_invariant_here(shape, torch.bfloat16) or _has_amx(), shape
    gen = torch.Generator().manual_seed(1)
    for in_features, out_features in [(576, 960), (1536, 576)]:
        q = torch.randint(0, 16, (out_features, in_features), generator=gen)
        scales = torch.rand(out_features, in_features // 32, generator=gen) * 0.01
        zeros = torch.full((out_features, in_features // 32), 8.0)
        packed, int4 = int4_linear.pack_cpu(q, scales, zeros, 32)
        assert invariance_failures(RowPadded(int4), packed, in_features, torch.float32) == []


def test_the_probe_catches_a_matmul_that_blocks_by_rows():
    def blocked(x, weight, bias=None):
        # Sums the reduction in halves when the batch is small: another rounding.
        products = x[:, None, :] * weight[None]  # [rows, out, in]: each sum is row-local
        if x.shape[0] < 8:
            half = x.shape[1] // 2
            return products[..., :half].sum(-1) + products[..., half:].sum(-1)
        return products.sum(-1)

    weight = torch.randn(32, 96, generator=torch.Generator().manual_seed(2))
    failures = invariance_failures(blocked, weight, 96, torch.float32)
    assert failures and all(rows < 8 for rows, _ in failures)


def test_per_token_tables():
    tables = [[5, 6, 7], [1, 2, 0], [3, 0, 0]]
    metadata = build_metadata([1, 3, 2], [9, 6, 2], [t[:3] for t in tables], 4, num_decodes=1)
    got_tables, got_lens = per_token_tables(metadata)
    assert got_lens.tolist() == [9, 4, 5, 6, 1, 2]
    assert got_tables[:, :2].tolist() == [[5, 6], [1, 2], [1, 2], [1, 2], [3, 0], [3, 0]]
    assert got_lens.dtype == torch.int32


def _sequence_cache(seq_len, other_len, block_size, dtype, fp8, seed):
    """A cache holding one sequence of ``seq_len`` tokens and a neighbour of ``other_len``,
    each in shuffled blocks, and a query per position of the first."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, num_heads, head_dim = 2, 6, 64
    need = -(-seq_len // block_size) + -(-other_len // block_size)
    perm = torch.randperm(need + 3, generator=gen).tolist()
    table = perm[: -(-seq_len // block_size)]
    other = perm[len(table) : need]
    kv = torch.randn(need + 3, 2, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    cache = quantize_rows(kv) if fp8 else kv
    query = torch.randn(seq_len, num_heads, head_dim, generator=gen).to(dtype)
    other_query = torch.randn(other_len, num_heads, head_dim, generator=gen).to(dtype)
    return cache, table, other, query, other_query


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    seq_len=st.integers(1, 600),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fp8=st.booleans(),
    block_size=st.sampled_from([16, 32]),
    neighbour=st.sampled_from(["none", "decode", "extend"]),
)
def test_attention_is_the_same_however_the_sequence_is_chunked(
    data, seq_len, dtype, fp8, block_size, neighbour
):
    other_len = data.draw(st.integers(1, 300))
    cache, table, other, query, other_query = _sequence_cache(
        seq_len, other_len, block_size, dtype, fp8, seed=seq_len
    )
    cuts = sorted({*data.draw(st.lists(st.integers(1, seq_len), max_size=5)), seq_len})
    scale = 0.125
    op = deterministic_kernel_ops("cpu").paged_attention
    # Reference: each position alone, as a decode of the positions up to it.
    alone = torch.cat([
        op(query[pos : pos + 1], cache, build_metadata([1], [pos + 1], [table], block_size, 1), scale)
        for pos in range(seq_len)
    ])  # fmt: skip
    start = 0
    for end in cuts:
        q_len = end - start
        if neighbour == "none":
            q, lens, seq_lens, tables, num_decodes, mine = (
                query[start:end],
                [q_len],
                [end],
                [table],
                0,
                0,
            )
        elif neighbour == "decode":  # the neighbour's last token decodes first in the batch
            q = torch.cat([other_query[-1:], query[start:end]])
            lens, seq_lens, tables, num_decodes, mine = (
                [1, q_len],
                [other_len, end],
                [other, table],
                1,
                1,
            )
        else:  # the neighbour prefills whole, after this chunk
            q = torch.cat([query[start:end], other_query])
            lens, seq_lens, tables, num_decodes, mine = (
                [q_len, other_len],
                [end, other_len],
                [table, other],
                0,
                0,
            )
        if q_len == 1 and neighbour != "decode":
            num_decodes = 1 if neighbour == "none" else num_decodes
        out = op(q, cache, build_metadata(lens, seq_lens, tables, block_size, num_decodes), scale)
        assert torch.equal(out[mine : mine + q_len], alone[start:end]), (start, end)
        start = end
    if not fp8:  # and it is attention: against a plain dense computation
        want = dense_reference(query, cache, [table], [seq_len], [seq_len], scale)
        torch.testing.assert_close(alone.float(), want, rtol=2e-2, atol=2e-2)
