"""The attention layer over the paged KV cache: store this step's K/V, then attend.

Owns no parameters; the projections and RoPE live in the model's attention module. Holds
the checkpoint's static FP8 KV scales where it has them (``workers/models/kv_scales.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import KernelOps
from kernels.attention_metadata import AttentionMetadata
from kernels.fp8_kv import is_fp8_cache


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_idx: int,
        ops: KernelOps,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.ops = ops
        # A checkpoint's static FP8 KV scales (fp8 = k / k_scale); None: each row's own.
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D].

        Writes k/v into this layer's slots of ``kv_cache``
        [num_blocks, num_layers, 2, Hkv, block_size, D] at ``attn_metadata.slot_mapping``.
        """
        kv_cache_layer = kv_cache[:, self.layer_idx]  # [num_blocks, 2, Hkv, block_size, D]
        has_static = self.k_scale is not None or self.v_scale is not None
        if has_static and is_fp8_cache(kv_cache_layer):
            self.ops.store_kv(
                k, v, kv_cache_layer, attn_metadata.slot_mapping, self.k_scale, self.v_scale
            )
        else:
            self.ops.store_kv(k, v, kv_cache_layer, attn_metadata.slot_mapping)
        out = self.ops.paged_attention(q, kv_cache_layer, attn_metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
