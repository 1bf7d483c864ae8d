"""Write the new tokens' K/V into one layer of the paged KV cache (plain-PyTorch reference).

Layouts:
    key, value:      [num_tokens, num_kv_heads, head_dim]
    kv_cache_layer:  [num_blocks, 2, num_kv_heads, block_size, head_dim]  (a view
                     ``kv_cache[:, layer]`` of the whole cache; index 0 of dim 1 is K, 1 is V)
    slot_mapping:    [num_tokens] int64, ``slot = block_id * block_size + offset_in_block``

A negative slot means "do not store this token" (e.g. a padding token); it is skipped.

An FP8 cache (``uint8``, rows of ``head_dim + 4`` bytes: ``kernels/fp8_kv.py``) gets each
token row quantized with its own scale (``amax / 448``), or with the layer's static
``k_scale``/``v_scale`` when the checkpoint has them.
"""

from __future__ import annotations

import torch

from kernels.fp8_kv import is_fp8_cache, quantize_rows


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Scatter ``key``/``value`` into ``kv_cache_layer`` at ``slot_mapping``; mutates the cache."""
    block_size = kv_cache_layer.shape[3]
    if key.shape != value.shape or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)} and "
            f"slot_mapping {tuple(slot_mapping.shape)} disagree"
        )
    is_valid = slot_mapping >= 0
    if not bool(is_valid.all()):
        key, value, slot_mapping = key[is_valid], value[is_valid], slot_mapping[is_valid]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    if is_fp8_cache(kv_cache_layer):
        key, value = quantize_rows(key, k_scale), quantize_rows(value, v_scale)
    # Indexing dims 0 and 3 around a slice puts the token dim first: [num_tokens, Hkv, D].
    kv_cache_layer[block_ids, 0, :, offsets] = key
    kv_cache_layer[block_ids, 1, :, offsets] = value
