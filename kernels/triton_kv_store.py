"""Write the step's K/V into one layer of the paged KV cache (Triton).

Layouts (same as the reference, ``kernels/kv_store.py``):
    key, value:      [num_tokens, num_kv_heads, head_dim]  (any strides, last dim contiguous:
                     usually views into the fused qkv projection's output)
    kv_cache_layer:  [num_blocks, 2, num_kv_heads, block_size, head_dim]  (the strided view
                     ``kv_cache[:, layer]``; index 0 of dim 1 is K, 1 is V)
    slot_mapping:    [num_tokens] int64, ``slot = block_id * block_size + offset_in_block``;
                     a negative slot is skipped

One program per token writes all its heads, K and V: two [num_kv_heads, head_dim] tiles, each
head's row landing in a contiguous ``head_dim`` run of the cache. Offsets are computed in
int64 (a whole cache easily exceeds 2**31 elements).

An FP8 cache (``uint8``, rows of ``head_dim`` FP8 bytes + a float32 scale:
``kernels/fp8_kv.py``) gets each head's row quantized with its own scale (``amax / 448``,
or the layer's static ``k_scale``/``v_scale``), bit for bit as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_kv import is_fp8_cache, packed_row_bytes
from kernels.triton_fp8_kv import quantize_rows


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_head,
    stride_kv_tok,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src = heads[:, None] * stride_k_head + dims[None, :]
    key = tl.load(key_ptr + token * stride_k_tok + src, mask=mask, other=0.0)
    src = heads[:, None] * stride_v_head + dims[None, :]
    value = tl.load(value_ptr + token * stride_v_tok + src, mask=mask, other=0.0)
    block = slot // BLOCK_SIZE
    row_ptrs = (
        kv_ptr + block * stride_kv_block + (slot % BLOCK_SIZE) * stride_kv_tok
    ) + heads * stride_kv_head  # [HEADS_PAD]: each head's row of this token
    dst_ptrs = row_ptrs[:, None] + dims[None, :]
    if IS_FP8:
        head_mask = heads < NUM_KV_HEADS
        key_fp8, key_scale = quantize_rows(key, k_scale, HAS_K_SCALE)
        value_fp8, value_scale = quantize_rows(value, v_scale, HAS_V_SCALE)
        scale_ptrs = (row_ptrs + HEAD_DIM).to(tl.pointer_type(tl.float32))
        tl.store(dst_ptrs, key_fp8, mask=mask)
        tl.store(scale_ptrs, key_scale, mask=head_mask)
        tl.store(dst_ptrs + stride_kv_kv, value_fp8, mask=mask)
        tl.store((row_ptrs + stride_kv_kv + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                 value_scale, mask=head_mask)  # fmt: skip
    else:
        tl.store(dst_ptrs, key, mask=mask)
        tl.store(dst_ptrs + stride_kv_kv, value, mask=mask)


def _check_inputs(
    key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.shape != value.shape or key.dim() != 3 or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)} and "
            f"slot_mapping {tuple(slot_mapping.shape)} disagree"
        )
    if kv_cache_layer.dim() != 5 or kv_cache_layer.shape[1] != 2:
        raise ValueError(
            f"store_kv: kv_cache_layer {tuple(kv_cache_layer.shape)} must be "
            "[num_blocks, 2, num_kv_heads, block_size, head_dim]"
        )
    row = packed_row_bytes(key.shape[2]) if is_fp8_cache(kv_cache_layer) else key.shape[2]
    if (kv_cache_layer.shape[2], kv_cache_layer.shape[4]) != (key.shape[1], row):
        raise ValueError(
            f"store_kv: key {tuple(key.shape)} does not fit kv_cache_layer "
            f"{tuple(kv_cache_layer.shape)} (num_kv_heads, head_dim)"
        )
    cache_dtype = key.dtype if is_fp8_cache(kv_cache_layer) else kv_cache_layer.dtype
    if not key.dtype == value.dtype == cache_dtype:
        raise ValueError(
            f"store_kv: dtypes differ (key {key.dtype}, value {value.dtype}, "
            f"cache {kv_cache_layer.dtype})"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise ValueError(f"store_kv: slot_mapping must be 1-D int64, got {slot_mapping.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache_layer.stride(4) != 1:
        raise ValueError(
            "store_kv: the head_dim axis of key, value and the cache must be contiguous"
        )
    if not slot_mapping.is_contiguous():
        raise ValueError("store_kv: slot_mapping must be contiguous")
    devices = {t.device for t in (key, value, kv_cache_layer, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"store_kv: tensors on several devices {devices}")


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Scatter ``key``/``value`` into ``kv_cache_layer`` at ``slot_mapping``; mutates the cache only."""
    _check_inputs(key, value, kv_cache_layer, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache_layer,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        kv_cache_layer.stride(2),
        kv_cache_layer.stride(3),
        1.0 if k_scale is None else float(k_scale),
        1.0 if v_scale is None else float(v_scale),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache_layer.shape[3],
        IS_FP8=is_fp8_cache(kv_cache_layer),
        HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
