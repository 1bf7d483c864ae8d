"""Prefill / extend attention over the paged KV cache (Triton), for chunked prefill and prefix hits.

Layouts (same as the reference, ``kernels/paged_attention.py``):
    query:           [num_tokens, num_heads, head_dim]  (flat, unpadded; last dim contiguous)
    kv_cache_layer:  [num_blocks, 2, num_kv_heads, block_size, head_dim]  (K at index 0 of dim 1)
    block_tables:    [num_seqs, max_num_blocks] int32
    seq_lens:        [num_seqs] int32, context length after this step (cached + new)
    query_start_loc: [num_seqs + 1] int32, ``cu_seqlens_q``: sequence ``s`` owns query rows
                     ``query_start_loc[s] .. query_start_loc[s + 1] - 1`` (need not start at 0)
    returns / out:   [num_tokens, num_heads, head_dim]; only the rows the sequences own are written

Sequence ``s`` with context ``L`` and ``q`` new tokens: query row ``i`` sits at position
``L - q + i`` and attends to every position ``<= L - q + i`` (causal, bottom-right aligned:
the cached prefix is fully visible). The new tokens' K/V must already be in the cache
(``store_kv`` runs first). Loads past a sequence's context are masked.

Grid: (sequence, query head, tile of BLOCK_M query rows); tiles past a sequence's query
length exit at once. Each program runs FlashAttention-2's online softmax over its keys in
two phases: tiles that every row of the query tile sees in full (no mask), then the tiles
that cross the causal diagonal (masked). Query head ``h`` reads kv head ``h // G``.

An FP8 cache (``uint8``: ``kernels/fp8_kv.py``) is dequantized tile by tile as it is loaded
(``IS_FP8``), to the query's dtype, the same as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_fp8_kv import check_cache, load_kv_tile

LOG2_E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    kv_head_ptr,
    table_ptr,
    q_pos,
    lo,
    hi,
    seq_len,
    scale_log2,
    stride_kv_kv,
    stride_kv_block,
    stride_kv_tok,
    dims,
    dim_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        if IS_MASKED:
            is_valid = pos < seq_len
            block_ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=is_valid, other=0)
        else:
            block_ids = tl.load(table_ptr + pos // BLOCK_SIZE)
        tok_offsets = block_ids.to(tl.int64) * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_tok
        row_ptrs = kv_head_ptr + tok_offsets
        if IS_MASKED:
            kv_mask = is_valid[:, None] & dim_mask[None, :]
            row_mask = is_valid
        else:
            kv_mask = dim_mask[None, :]
            row_mask = pos >= 0  # every row
        k = load_kv_tile(row_ptrs, dims, kv_mask, row_mask, HEAD_DIM, IS_FP8).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if IS_MASKED:
            is_visible = (pos[None, :] <= q_pos[:, None]) & is_valid[None, :]
            scores = tl.where(is_visible, scores, float("-inf"))
        # Every row sees position 0 in the first tile it processes, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(row_ptrs + stride_kv_kv, dims, kv_mask, row_mask, HEAD_DIM, IS_FP8)
        v = v.to(q.dtype)  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_attention_kernel(
    query_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_head,
    stride_kv_tok,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len  # cached positions before this step's tokens

    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < query_len
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    tokens = (q_start + rows).to(tl.int64)
    q_ptrs = query_ptr + tokens[:, None] * stride_q_tok + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos = prefix_len + rows  # positions of the tile's query rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    kv_head_ptr = kv_ptr + (head // GROUP).to(tl.int64) * stride_kv_head
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    # Keys below the tile's first query position are visible to every row: no mask.
    full_hi = ((prefix_len + m0 + 1) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(prefix_len + m0 + BLOCK_M, seq_len)
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        kv_head_ptr,
        table_ptr,
        q_pos,
        0,
        full_hi,
        seq_len,
        scale_log2,
        stride_kv_kv,
        stride_kv_block,
        stride_kv_tok,
        dims,
        dim_mask,
        BLOCK_SIZE,
        BLOCK_N,
        False,
        DOT_PRECISION,
        HEAD_DIM,
        IS_FP8,
    )
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        kv_head_ptr,
        table_ptr,
        q_pos,
        full_hi,
        hi,
        seq_len,
        scale_log2,
        stride_kv_kv,
        stride_kv_block,
        stride_kv_tok,
        dims,
        dim_mask,
        BLOCK_SIZE,
        BLOCK_N,
        True,
        DOT_PRECISION,
        HEAD_DIM,
        IS_FP8,
    )
    acc = acc / l_i[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_o_tok + head * stride_o_head + dims[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def launch_config(
    dtype: torch.dtype, head_dim_pad: int, is_cuda: bool
) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for a launch.

    CUDA: chosen offline for sm_90 (``python -m bench.gpu_kernels --compile-only``: compiled
    without a GPU, registers from ``cuobjdump``): the largest tiles that do not spill
    (float32 with "ieee" dots runs on FMA units and spills least with small tiles). Not yet
    timed on a GPU. The interpreter: small tiles keep its per-op arrays small.
    """
    if not is_cuda:
        return 32, 32, 4, 1
    if dtype == torch.float32:
        return 32, 32, 8, 2
    if head_dim_pad > 128:
        return 64, 32, 8, 2
    return 128, 64, 8, 3


def _check_inputs(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
) -> None:
    name = "prefill_attention"
    if query.dim() != 3 or kv_cache_layer.dim() != 5 or kv_cache_layer.shape[1] != 2:
        raise ValueError(
            f"{name}: query {tuple(query.shape)} must be [T, Hq, D] and kv_cache_layer "
            f"{tuple(kv_cache_layer.shape)} [num_blocks, 2, Hkv, block_size, D]"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache_layer.shape[2]
    _, cache_head_dim = check_cache(name, query, kv_cache_layer)
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"{name}: query {tuple(query.shape)} does not fit kv_cache_layer "
            f"{tuple(kv_cache_layer.shape)} (head_dim, or num_heads not a multiple of num_kv_heads)"
        )
    num_seqs = seq_lens.shape[0]
    if (
        seq_lens.dim() != 1
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or query_start_loc.shape != (num_seqs + 1,)
    ):
        raise ValueError(
            f"{name}: block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} "
            f"and query_start_loc {tuple(query_start_loc.shape)} disagree on the sequence count"
        )
    for tensor, label in (
        (block_tables, "block_tables"),
        (seq_lens, "seq_lens"),
        (query_start_loc, "query_start_loc"),
    ):
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name}: {label} must be int32, got {tensor.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables rows must be contiguous")
    if out.dtype != query.dtype:
        raise ValueError(f"{name}: dtypes differ (query {query.dtype}, out {out.dtype})")
    if out.shape != query.shape:
        raise ValueError(f"{name}: out {tuple(out.shape)} != query {tuple(query.shape)}")
    if query.stride(2) != 1 or kv_cache_layer.stride(4) != 1 or out.stride(2) != 1:
        raise ValueError(f"{name}: the head_dim axis must be contiguous")
    tensors = (query, kv_cache_layer, block_tables, seq_lens, query_start_loc, out)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on several devices {devices}")


def prefill_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its paged context; returns ``out``.

    Reads ``kv_cache_layer``; writes the rows of ``out`` that the sequences own (``out`` is
    allocated when None). ``max_query_len`` (a host int) bounds the per-sequence query
    lengths. ``block_m`` / ``block_n`` (query rows / keys per tile) are tuning knobs.
    """
    if out is None:
        out = torch.empty_like(query)
    _check_inputs(query, kv_cache_layer, block_tables, seq_lens, query_start_loc, out)
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    if num_seqs == 0 or max_query_len == 0:
        return out
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    default_m, default_n, num_warps, num_stages = launch_config(
        query.dtype, head_dim_pad, query.is_cuda
    )
    block_m, block_n = block_m or default_m, block_n or default_n
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_attention_kernel[grid](
        query,
        kv_cache_layer,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        kv_cache_layer.stride(2),
        kv_cache_layer.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        IS_FP8=check_cache("prefill_attention", query, kv_cache_layer)[0],
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
