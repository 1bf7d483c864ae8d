"""Paged decode attention (Triton): one query token per sequence over its paged KV context.

Layouts (same as the reference, ``kernels/paged_attention.py``):
    query:          [num_seqs, num_heads, head_dim]      (last dim contiguous; any other strides)
    kv_cache_layer: [num_blocks, 2, num_kv_heads, block_size, head_dim]  (the strided view
                    ``kv_cache[:, layer]``; index 0 of dim 1 is K, 1 is V; last dim contiguous)
    block_tables:   [num_seqs, max_num_blocks] int32
    seq_lens:       [num_seqs] int32, context length including this step's token
    returns / out:  [num_seqs, num_heads, head_dim]

Sequence ``s`` attends to positions ``0 .. seq_lens[s] - 1``; position ``p`` lives in block
``block_tables[s, p // block_size]`` at offset ``p % block_size``. Loads past ``seq_lens`` are
masked, so unowned slots may hold anything (even NaN).

One program handles one (sequence, kv head, context split) and all ``G = num_heads //
num_kv_heads`` query heads that share the kv head: each K/V tile is read once for the group
(GQA of any ratio; the group is padded to 16 rows for ``tl.dot``). Head dims that are not a
power of two (80, 96) are padded to the next one with masked loads and stores.

An FP8 cache (``uint8``, rows of ``head_dim`` FP8 bytes + a float32 scale:
``kernels/fp8_kv.py``) is dequantized tile by tile as it is loaded (``IS_FP8``), to the
query's dtype, the same as the reference.

Flash-decoding: with few sequences and long contexts the context is cut into
``num_splits`` equal ranges processed in parallel; each writes an unnormalised partial
output and its log-sum-exp (base 2) to float32 scratch, and ``decode_reduce_kernel``
(``kernels/triton_decode_reduce.py``) combines them. With one split the kernel writes the normalised output directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_decode_reduce import decode_reduce_kernel, decode_reduce_ordered_kernel
from kernels.triton_fp8_kv import check_cache, load_kv_tile

LOG2_E = 1.4426950408889634
# Do not cut a sequence into ranges shorter than this: below it the reduction costs more
# than the parallelism gains.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _paged_decode_kernel(
    query_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    tokens_per_split,
    stride_q_seq,
    stride_q_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_head,
    stride_kv_tok,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)  # query heads of the group (padded)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_ptrs = query_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
    q = tl.load(q_ptrs + dims[None, :], mask=q_mask, other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    kv_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        is_valid = pos < hi
        block_ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
        tok_offsets = block_ids * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_tok
        row_ptrs = kv_head_ptr + tok_offsets
        kv_mask = is_valid[:, None] & dim_mask[None, :]
        k = load_kv_tile(row_ptrs, dims, kv_mask, is_valid, HEAD_DIM, IS_FP8).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(is_valid[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        # Every tile holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(row_ptrs + stride_kv_kv, dims, kv_mask, is_valid, HEAD_DIM, IS_FP8)
        v = v.to(q.dtype)  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (past this sequence's end) leaves l_i == 0: output 0, weight exp2(-inf).
    has_tokens = l_i > 0.0
    l_safe = tl.where(has_tokens, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if IS_SPLIT:
        lse = tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf"))
        pl_ptrs = partial_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split
        tl.store(pl_ptrs, lse, mask=row_mask)
        po_ptrs = (
            partial_out_ptr
            + seq * stride_po_seq
            + heads[:, None] * stride_po_head
            + split * stride_po_split
            + dims[None, :]
        )
        tl.store(po_ptrs, acc, mask=q_mask)
    else:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
        tl.store(o_ptrs + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=q_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Context splits per sequence: enough programs for several waves over the SMs (a few
    programs fit on one SM at once, and more, shorter programs even out the tail), never
    ranges shorter than ``_MIN_TOKENS_PER_SPLIT``. The partial outputs cost
    ``num_splits * head_dim * 4`` bytes per head, small next to the context's K/V."""
    wanted = triton.cdiv(8 * num_sms, num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS))


def launch_config(dtype: torch.dtype, is_cuda: bool) -> tuple[int, int]:
    """(block_n, num_warps). CUDA: 64 positions per tile, 4 warps (8 for float32, whose
    "ieee" dots run on FMA units): no register spills and room for several programs per SM,
    chosen offline for sm_90 (``python -m bench.gpu_kernels --compile-only``), not yet timed on
    a GPU. The interpreter: 32 positions, so small test contexts still span several tiles."""
    if not is_cuda:
        return 32, 4
    return 64, (8 if dtype == torch.float32 else 4)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in full precision (no TF32), so they match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_inputs(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    if query.dim() != 3 or kv_cache_layer.dim() != 5 or kv_cache_layer.shape[1] != 2:
        raise ValueError(
            f"paged_decode_attention: query {tuple(query.shape)} must be [N, Hq, D] and "
            f"kv_cache_layer {tuple(kv_cache_layer.shape)} [num_blocks, 2, Hkv, block_size, D]"
        )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache_layer.shape[2]
    _, cache_head_dim = check_cache("paged_decode_attention", query, kv_cache_layer)
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"paged_decode_attention: query {tuple(query.shape)} does not fit kv_cache_layer "
            f"{tuple(kv_cache_layer.shape)} (head_dim, or num_heads not a multiple of num_kv_heads)"
        )
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or seq_lens.shape != (num_seqs,)
    ):
        raise ValueError(
            f"paged_decode_attention: block_tables {tuple(block_tables.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must describe {num_seqs} sequences"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("paged_decode_attention: block_tables and seq_lens must be int32")
    if block_tables.stride(1) != 1:
        raise ValueError("paged_decode_attention: block_tables rows must be contiguous")
    if out.dtype != query.dtype:
        raise ValueError(
            f"paged_decode_attention: dtypes differ (query {query.dtype}, out {out.dtype})"
        )
    if out.shape != query.shape:
        raise ValueError(f"paged_decode_attention: out {tuple(out.shape)} != {tuple(query.shape)}")
    if query.stride(2) != 1 or kv_cache_layer.stride(4) != 1 or out.stride(2) != 1:
        raise ValueError("paged_decode_attention: the head_dim axis must be contiguous")
    devices = {t.device for t in (query, kv_cache_layer, block_tables, seq_lens, out)}
    if len(devices) != 1:
        raise ValueError(f"paged_decode_attention: tensors on several devices {devices}")


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """Attend each sequence's one query token to its paged context; returns ``out``.

    Reads ``kv_cache_layer``; writes every element of ``out`` (allocated when None).
    ``max_seq_len`` (a host int, no device sync) bounds ``seq_lens`` and sizes the splits;
    ``num_splits`` (default: chosen from the GPU's size) and ``block_n`` (tokens per tile)
    are tuning knobs that tests use to force the split and multi-tile paths.
    ``split_tokens`` (a multiple of the tile, batch-invariant runs): cut every context at
    multiples of it, always through the partial outputs, and combine each sequence's own
    splits in order, so a sequence's result does not depend on the batch (``num_splits``
    is then ignored).
    """
    if out is None:
        out = torch.empty_like(query)
    _check_inputs(query, kv_cache_layer, block_tables, seq_lens, out)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    default_n, num_warps = launch_config(query.dtype, query.is_cuda)
    block_n = block_n or default_n
    if num_splits is None:  # one pass in the interpreter
        num_splits = (
            choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device))
            if query.is_cuda
            else 1
        )
    # Equal ranges, each a whole number of tiles; trailing empty ranges are dropped.
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    if split_tokens is not None:
        if split_tokens % block_n:
            raise ValueError(f"split_tokens {split_tokens} is not a multiple of {block_n}")
        tokens_per_split = split_tokens
    num_splits = triton.cdiv(max(max_seq_len, 1), tokens_per_split)
    is_split = num_splits > 1 or split_tokens is not None
    if is_split:
        partial_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
    else:  # unused by the kernel; any tensor will do
        partial_out = partial_lse = out
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache_layer,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        scale * LOG2_E,
        tokens_per_split,
        query.stride(0),
        query.stride(1),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        kv_cache_layer.stride(2),
        kv_cache_layer.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision(query.dtype),
        IS_FP8=check_cache("paged_decode_attention", query, kv_cache_layer)[0],
        num_warps=num_warps,
        num_stages=2,
    )
    if split_tokens is not None:
        decode_reduce_ordered_kernel[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            seq_lens,
            out,
            tokens_per_split,
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4,
        )
    elif is_split:
        decode_reduce_kernel[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            out,
            num_splits,
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4,
        )
    return out
