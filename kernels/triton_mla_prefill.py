"""Multi-head latent attention's prefill chunks on the paged latent cache (Triton): the
``KernelOps.mla_prefill_attention`` of the Triton set, with the reference's signature
(``kernels/mla_attention.py``, which has the layouts).

    q:             [num_extend_tokens, num_heads, R + P]  the extends' absorbed queries,
                   ``[q_nope W_UK, q_pe]``, in batch order after the decodes
    latent_cache:  [num_blocks, block_size, R + P]        one layer's strided view
    returns:       [num_extend_tokens, num_heads, R]      in q's dtype

A chunk of ``q_len`` tokens in a context of ``seq_len`` (its prefix from the prefix cache or
earlier chunks, and the chunk itself, already stored): query ``i`` sits at position
``seq_len - q_len + i`` and sees every row up to it (causal, bottom-right aligned). The
chunk attends on the latent rows directly, as a decode does (``triton_mla_decode``): no
gather, no expansion through ``kv_b_proj``, the prefix read in place from its blocks.

Grid: (tile of ``BLOCK_M`` query rows, extend sequence). MLA has one "kv head" for every
query head, so a tile's rows are (token, head) pairs, ``row = token * num_heads + head``:
all of them score the same latent tiles, each ``c_kv`` [BLOCK_N, R] / ``k_pe`` [BLOCK_N, P]
tile is loaded once for ``BLOCK_M`` rows and is both key (with ``k_pe``) and value. Each
row's causal limit is its own token's position; the loop runs to the tile's last token.
Online softmax in base 2, float32 accumulators. An FP8 latent cache is dequantized tile by
tile as it is loaded (``load_latent_tile``, shared with the decode kernel).

Why absorbed and not expanded: the paged prefix needs no gather and the FP8 rows no
dequantized copy, and one launch serves every chunk of the batch; the price is
``2R + P`` multiply-adds per (query, key, head) against ``dn + P + dv`` after an
expansion of ``R (dn + dv)`` per key and head, so expanding is cheaper for chunks longer
than about ``R (dn + dv) / (2R - dn - dv)`` tokens (170 at V3's shapes). Not timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.triton_mla_decode import _check_inputs, load_latent_tile
from kernels.triton_paged_decode import LOG2_E, dot_precision


@triton.jit
def _mla_prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    first_row,
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_tok,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    # query_start_loc counts the batch's rows from its first decode: less first_row, q's.
    q_start = tl.load(query_start_loc_ptr + seq) - first_row
    query_len = tl.load(query_start_loc_ptr + seq + 1) - first_row - q_start
    if tile * BLOCK_M >= query_len * num_heads:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    row_ids = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = row_ids // num_heads
    head = row_ids % num_heads
    is_row = token < query_len
    q_pos = seq_len - query_len + token  # [BLOCK_M]: each row's causal limit

    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    r_mask = r < RANK
    q_rows = q_ptr + (q_start + token).to(tl.int64) * stride_q_tok + head * stride_q_head
    q_lat = tl.load(q_rows[:, None] + r[None, :], mask=is_row[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(
        q_rows[:, None] + RANK + p[None, :], mask=is_row[:, None] & (p < ROPE)[None, :], other=0.0
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // num_heads, query_len - 1)
    hi = seq_len - query_len + last_token + 1  # the tile's last row sees up to here
    for start in range(0, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        is_valid = pos < hi
        c_kv, k_pe = load_latent_tile(
            cache_ptr, table_ptr, pos, is_valid, r, p, stride_c_block, stride_c_tok,
            RANK, ROPE, BLOCK_SIZE, IS_FP8,
        )  # fmt: skip
        c_kv, k_pe = c_kv.to(q_lat.dtype), k_pe.to(q_pe.dtype)
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        is_seen = is_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(is_seen, scores * scale_log2, float("-inf"))
        # Position 0 is in the first tile and every row sees it, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(
            prob.to(c_kv.dtype), c_kv, input_precision=DOT_PRECISION
        )
        m_i = m_new

    acc = acc / l_i[:, None]
    o_rows = out_ptr + (q_start + token).to(tl.int64) * stride_o_tok + head * stride_o_head
    out_mask = is_row[:, None] & r_mask[None, :]
    tl.store(o_rows[:, None] + r[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def launch_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps): 16 (token, head) rows by 32 positions, 8 warps. Not
    timed on a GPU; compiled for sm_90 at R = 512, P = 64 (``python -m bench.gpu_kernels
    --compile-only``), the one tile of those tried with no spills at bfloat16, its FP8
    rows and float32: 160 / 237 / 193 registers (32 x 32 rows spilled with FP8 rows, 4
    warps spilled with FP8 rows or float32)."""
    return 16, 32, 8


def mla_prefill_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """The batch's extends on their cached latents, causally: [T, H, R + P] -> [T, H, R]
    (a new tensor); reads the cache only. ``block_m`` / ``block_n`` (rows and positions
    per tile) are tuning knobs tests use."""
    is_fp8 = _check_inputs(q, latent_cache, kv_lora_rank)
    num_tokens, num_heads, width = q.shape
    num_decodes = metadata.num_decodes
    query_lens = metadata.query_lens_cpu[num_decodes:]
    if num_tokens != sum(query_lens):
        raise ValueError(f"{num_tokens} queries for {sum(query_lens)} extend tokens")
    out = q.new_empty(num_tokens, num_heads, kv_lora_rank)
    if num_tokens == 0:
        return out
    default_m, default_n, num_warps = launch_config(q.dtype)
    block_m, block_n = block_m or default_m, block_n or default_n
    block_tables = metadata.block_tables[num_decodes:]
    rope = width - kv_lora_rank
    # Tiles on axis 0 (up to 2^31 - 1): a long chunk of many heads passes axis 1's 65535.
    grid = (triton.cdiv(max(query_lens) * num_heads, block_m), len(query_lens))
    _mla_prefill_kernel[grid](
        q,
        latent_cache,
        block_tables,
        metadata.seq_lens[num_decodes:],
        metadata.query_start_loc[num_decodes:],
        out,
        scale * LOG2_E,
        num_decodes,  # the decodes' rows (one each) come first in query_start_loc
        num_heads,
        q.stride(0),
        q.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        RANK=kv_lora_rank,
        RANK_PAD=max(16, triton.next_power_of_2(kv_lora_rank)),
        ROPE=rope,
        ROPE_PAD=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        IS_FP8=is_fp8,
        num_warps=num_warps,
        num_stages=2,
    )
    return out
