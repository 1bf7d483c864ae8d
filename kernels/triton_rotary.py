"""Rotary position embedding (Triton), applied **in place** to q and k.

Layouts (same as the reference, ``kernels/rotary.py``; Hugging Face ``rotate_half`` layout):
    cos_sin_cache: [max_position, rotary_dim]; row ``p`` is ``cat(cos(p * inv_freq),
                   sin(p * inv_freq))`` (``compute_cos_sin_cache``: default, linear and
                   llama3 scaling are all in the table, so the kernel is the same for all)
    q:             [num_tokens, num_heads, head_dim]     (any strides, last dim contiguous:
    k:             [num_tokens, num_kv_heads, head_dim]   usually views into the qkv output)
    positions:     [num_tokens] int64

Features ``j`` and ``j + rotary_dim // 2`` (``j < rotary_dim // 2``) of every head rotate by
the angle of ``positions[t]``; features past ``rotary_dim`` are left untouched.

One program per token rotates all heads of q and of k, each as a [heads, rotary_dim // 2]
tile pair. The table row is rounded to q's dtype first (as the reference does), the rotation
itself runs in float32 and is rounded once.

Contract (``KernelOps.apply_rotary``): returns ``(q, k)`` — the same tensors, rotated. The
reference returns new tensors instead, so callers must use the returned pair and must not
rely on the inputs being left unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    cos,
    sin,
    stride_head,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate the [NUM_HEADS, 2 * HALF] leading features of one token's heads in place."""
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < HALF)
    x1_ptrs = x_ptr + heads[:, None] * stride_head + cols[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(x1_ptrs, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x1_ptrs + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cs_pos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)
    cs_ptrs = cos_sin_ptr + position * stride_cs_pos + cols
    # Rounded to q's dtype first, as the reference casts the gathered table rows.
    cos = tl.load(cs_ptrs, mask=cols < HALF, other=0.0).to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(cs_ptrs + HALF, mask=cols < HALF, other=0.0)
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
    q_tok_ptr = q_ptr + token * stride_q_tok
    k_tok_ptr = k_ptr + token * stride_k_tok
    _rotate_heads(q_tok_ptr, cos, sin, stride_q_head, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_tok_ptr, cos, sin, stride_k_head, NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"apply_rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, head_dim]"
        )
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(
            f"apply_rotary: positions {tuple(positions.shape)} {positions.dtype} must be "
            f"[{q.shape[0]}] int64"
        )
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rotary_dim % 2 or rotary_dim > q.shape[2]:
        raise ValueError(
            f"apply_rotary: cos_sin_cache {tuple(cos_sin_cache.shape)} must be "
            f"[max_position, rotary_dim] with an even rotary_dim <= head_dim {q.shape[2]}"
        )
    if q.dtype != k.dtype:
        raise ValueError(f"apply_rotary: q {q.dtype} and k {k.dtype} differ")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("apply_rotary: the last dim of q, k and cos_sin_cache must be contiguous")
    if not positions.is_contiguous():
        raise ValueError("apply_rotary: positions must be contiguous")
    devices = {t.device for t in (q, k, positions, cos_sin_cache)}
    if len(devices) != 1:
        raise ValueError(f"apply_rotary: tensors on several devices {devices}")


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] in place; returns ``(q, k)``.

    Mutates ``q`` and ``k`` (the features below ``rotary_dim`` of every head). Positions must
    lie in ``[0, max_position)``; they are not checked on the device.
    """
    _check_inputs(q, k, positions, cos_sin_cache)
    num_tokens, num_q_heads, _ = q.shape
    num_k_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if num_tokens == 0 or half == 0:
        return q, k
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4 if num_q_heads * half >= 2048 else 1,
    )
    return q, k
