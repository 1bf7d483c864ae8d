"""Multi-head latent attention's decodes on the paged latent cache (Triton): the
``KernelOps.mla_decode_attention`` of the Triton set, with the reference's signature
(``kernels/mla_attention.py``, which has the layouts).

    q:             [num_decodes, num_heads, R + P]   absorbed queries, ``[q_nope W_UK, q_pe]``
    latent_cache:  [num_blocks, block_size, R + P]   one layer's strided view; rows contiguous
    returns:       [num_decodes, num_heads, R]       in q's dtype

One program handles one (sequence, group of 16 query heads, context split). MLA has one
"kv head" that every query head reads, so each latent tile is loaded once for the whole
group: per tile of ``BLOCK_N`` positions, ``c_kv`` [BLOCK_N, R] and ``k_pe`` [BLOCK_N, P]
are loaded (two masked loads of the row, so R and P are padded to powers of two
separately: 512 + 64, not 1024), the scores are ``q_lat c_kv^T + q_pe k_pe^T``, and the
same ``c_kv`` tile is the value: ``acc += p c_kv``. Online softmax in base 2.

An FP8 latent cache (``uint8`` rows of ``R + P`` float8_e4m3fn values and one float32
scale, ``kernels/mla_attention.py``) is dequantized tile by tile as it is loaded
(``IS_FP8``): the row's scale once, both parts multiplied by it.

Flash-decoding as ``kernels/triton_paged_decode.py``: with few sequences the context is
cut into splits whose partial outputs (float32, [N, H, splits, R_pad]) and log-sum-exps
``decode_reduce_kernel`` combines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.fp8_kv import is_fp8_cache, unpacked_head_dim
from kernels.triton_decode_reduce import decode_reduce_kernel
from kernels.triton_paged_decode import LOG2_E, _num_sms, choose_num_splits, dot_precision

_BLOCK_H = 16  # query heads per program (tl.dot's smallest M)


@triton.jit
def load_latent_tile(
    cache_ptr,
    table_ptr,
    pos,
    is_valid,
    r,
    p,
    stride_c_block,
    stride_c_tok,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    """The cached rows at positions ``pos`` of one sequence (``table_ptr``: its block table)
    as ``(c_kv [BLOCK_N, RANK_PAD], k_pe [BLOCK_N, ROPE_PAD])``: the cache's dtype, or
    float32 from an FP8 row (its values times its scale). Positions where ``is_valid`` is
    false, and the padding of R and P, read 0. Shared with ``triton_mla_prefill``."""
    block_ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
    rows = cache_ptr + block_ids * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok
    c_mask = is_valid[:, None] & (r < RANK)[None, :]
    p_mask = is_valid[:, None] & (p < ROPE)[None, :]
    if IS_FP8:  # bytes: R + P float8_e4m3fn values, then the row's float32 scale
        row_scale = tl.load(
            (rows + RANK + ROPE).to(tl.pointer_type(tl.float32)), mask=is_valid, other=0.0
        )[:, None]
        c_raw = tl.load(rows[:, None] + r[None, :], mask=c_mask, other=0)
        c_kv = c_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * row_scale
        p_raw = tl.load(rows[:, None] + RANK + p[None, :], mask=p_mask, other=0)
        k_pe = p_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * row_scale
    else:
        c_kv = tl.load(rows[:, None] + r[None, :], mask=c_mask, other=0.0)
        k_pe = tl.load(rows[:, None] + RANK + p[None, :], mask=p_mask, other=0.0)
    return c_kv, k_pe


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    tokens_per_split,
    num_heads,
    stride_q_seq,
    stride_q_head,
    stride_c_block,
    stride_c_tok,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    BLOCK_H: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    r_mask = r < RANK
    p_mask = p < ROPE
    q_rows = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
    q_lat = tl.load(q_rows + r[None, :], mask=head_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + RANK + p[None, :], mask=head_mask[:, None] & p_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        is_valid = pos < hi
        c_kv, k_pe = load_latent_tile(
            cache_ptr, table_ptr, pos, is_valid, r, p, stride_c_block, stride_c_tok,
            RANK, ROPE, BLOCK_SIZE, IS_FP8,
        )  # fmt: skip
        c_kv, k_pe = c_kv.to(q_lat.dtype), k_pe.to(q_pe.dtype)
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores = tl.where(is_valid[None, :], scores * scale_log2, float("-inf"))
        # Every tile holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(
            prob.to(c_kv.dtype), c_kv, input_precision=DOT_PRECISION
        )
        m_i = m_new

    # An empty split (past this sequence's end) leaves l_i == 0: output 0, weight exp2(-inf).
    has_tokens = l_i > 0.0
    l_safe = tl.where(has_tokens, l_i, 1.0)
    acc = acc / l_safe[:, None]
    out_mask = head_mask[:, None] & r_mask[None, :]
    if IS_SPLIT:
        lse = tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf"))
        pl_ptrs = partial_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split
        tl.store(pl_ptrs, lse, mask=head_mask)
        po_ptrs = (
            partial_out_ptr
            + seq * stride_po_seq
            + heads[:, None] * stride_po_head
            + split * stride_po_split
            + r[None, :]
        )
        tl.store(po_ptrs, acc, mask=out_mask)
    else:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
        tl.store(o_ptrs + r[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def launch_config(dtype: torch.dtype) -> tuple[int, int]:
    """(block_n, num_warps): 32 positions per tile, 4 warps (8 for float32). Not timed on
    a GPU yet; compiled for sm_90 at R = 512, P = 64 (``python -m bench.gpu_kernels
    --compile-only``): no spills, 223 registers at bf16 (8 warps: 124), 55 KB shared."""
    return 32, (8 if dtype == torch.float32 else 4)


def _check_inputs(q: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether the cache is packed FP8; ValueError naming what disagrees."""
    is_fp8 = is_fp8_cache(latent_cache)
    width = unpacked_head_dim(latent_cache) if is_fp8 else latent_cache.shape[-1]
    if q.dim() != 3 or latent_cache.dim() != 3 or q.shape[2] != width:
        raise ValueError(
            f"mla_decode_attention: q {tuple(q.shape)} must be [N, H, R + P] and the latent "
            f"cache {tuple(latent_cache.shape)} [num_blocks, block_size, R + P]"
        )
    if not 0 < kv_lora_rank < q.shape[2]:
        raise ValueError(f"mla_decode_attention: kv_lora_rank {kv_lora_rank} of {q.shape[2]}")
    if q.stride(2) != 1 or latent_cache.stride(2) != 1:
        raise ValueError("mla_decode_attention: the row axis must be contiguous")
    if latent_cache.dtype != q.dtype and not is_fp8:
        raise ValueError(f"mla_decode_attention: cache {latent_cache.dtype}, q {q.dtype}")
    return is_fp8


def mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """The batch's decodes on their cached latents: [N, H, R + P] -> [N, H, R] (a new
    tensor); reads the cache only. ``num_splits`` (default: from the GPU's size; 1 in
    the interpreter) and ``block_n`` (positions per tile) are tuning knobs tests use."""
    is_fp8 = _check_inputs(q, latent_cache, kv_lora_rank)
    num_decodes, num_heads, width = q.shape
    if num_decodes != metadata.num_decodes:
        raise ValueError(f"{num_decodes} queries for {metadata.num_decodes} decodes")
    out = q.new_empty(num_decodes, num_heads, kv_lora_rank)
    if num_decodes == 0:
        return out
    block_tables = metadata.block_tables[:num_decodes]
    seq_lens = metadata.seq_lens[:num_decodes]
    max_seq_len = max(metadata.seq_lens_cpu[:num_decodes])
    rank_pad = max(16, triton.next_power_of_2(kv_lora_rank))
    rope = width - kv_lora_rank
    default_n, num_warps = launch_config(q.dtype)
    block_n = block_n or default_n
    head_blocks = triton.cdiv(num_heads, _BLOCK_H)
    if num_splits is None:
        num_splits = (
            choose_num_splits(num_decodes, head_blocks, max_seq_len, _num_sms(q.device))
            if q.is_cuda
            else 1
        )
    tokens_per_split = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, tokens_per_split)
    is_split = num_splits > 1
    if is_split:
        partial_out = torch.empty(
            num_decodes, num_heads, num_splits, rank_pad, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            num_decodes, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:  # unused by the kernel
        partial_out = partial_lse = out
    _mla_decode_kernel[(num_decodes, head_blocks, num_splits)](
        q,
        latent_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        scale * LOG2_E,
        tokens_per_split,
        num_heads,
        q.stride(0),
        q.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        BLOCK_H=_BLOCK_H,
        RANK=kv_lora_rank,
        RANK_PAD=rank_pad,
        ROPE=rope,
        ROPE_PAD=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_N=block_n,
        IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision(q.dtype),
        IS_FP8=is_fp8,
        num_warps=num_warps,
        num_stages=2,
    )
    if is_split:
        decode_reduce_kernel[(num_decodes, num_heads)](
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
            HEAD_DIM=kv_lora_rank,
            HEAD_DIM_PAD=rank_pad,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4,
        )
    return out
