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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src = heads[:, None] * stride_k_head + dims[None, :]
    key = tl.load(key_ptr + token * stride_k_tok + src, mask=mask)
    src = heads[:, None] * stride_v_head + dims[None, :]
    value = tl.load(value_ptr + token * stride_v_tok + src, mask=mask)
    block = slot // BLOCK_SIZE
    dst_ptrs = (
        kv_ptr
        + block * stride_kv_block
        + (slot % BLOCK_SIZE) * stride_kv_tok
        + heads[:, None] * stride_kv_head
        + dims[None, :]
    )
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
    if (kv_cache_layer.shape[2], kv_cache_layer.shape[4]) != (key.shape[1], key.shape[2]):
        raise ValueError(
            f"store_kv: key {tuple(key.shape)} does not fit kv_cache_layer "
            f"{tuple(kv_cache_layer.shape)} (num_kv_heads, head_dim)"
        )
    if not key.dtype == value.dtype == kv_cache_layer.dtype:
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
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache_layer.shape[3],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
