"""The FP8 KV-cache format: float8_e4m3fn values with a float32 scale per token row (reference).

A cache of ``kv_cache_dtype: fp8_e4m3`` is a ``uint8`` tensor whose last axis packs, for one
token of one kv head (of one layer, K or V), its ``head_dim`` FP8 values and then their scale::

    kv_cache:        [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim + 4] uint8
    one token row:   head_dim bytes of float8_e4m3fn | 4 bytes of float32 scale

    value = float(fp8) * scale

Why a scale per (layer, kv head, token) packed into the row (docs/kv-cache-layout.md, "FP8"):
the scale is derived when the row is written, from that row alone (``amax / 448``), so a row
never changes after it is written and does not depend on what else was in the batch, on the
chunking of the prompt or on which worker computed it. A block is self-describing: prefix-cache
reuse, copy-on-write and the NIXL hand-off move its bytes and nothing else (the scales travel
inside the block, and inside each kv head's contiguous sub-region, so tensor-parallel head
slicing works unchanged). A checkpoint's static per-layer scale, where present, replaces
``amax / 448`` (values beyond it saturate at +-448).

The cache's dtype is the switch: the attention and store ops take the FP8 path for a
``uint8`` cache. ``head_dim % 4 == 0`` keeps the scale 4-byte aligned.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # one float32 per token row
# A row of zeros gets this scale, not 0: dequantizing multiplies, and 0 * finite stays exact.
MIN_SCALE = 1e-12


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """True for a packed FP8 cache (or layer view of one)."""
    return kv_cache.dtype == torch.uint8


def packed_row_bytes(head_dim: int) -> int:
    """Bytes of one packed token row of one kv head."""
    if head_dim % SCALE_BYTES:
        raise ValueError(f"the FP8 KV cache needs head_dim % 4 == 0, got {head_dim}")
    return head_dim + SCALE_BYTES


def unpacked_head_dim(packed: torch.Tensor) -> int:
    return packed.shape[-1] - SCALE_BYTES


def quantize_rows(x: torch.Tensor, static_scale: float | None = None) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] packed uint8 rows (new tensor).

    Each row's scale is ``amax(|row|) / 448`` (or ``static_scale``); values are
    ``x / scale`` rounded to the nearest float8_e4m3fn, saturating at +-448.
    """
    head_dim = x.shape[-1]
    packed_row_bytes(head_dim)
    x32 = x.float()
    if static_scale is None:
        amax = x32.abs().amax(dim=-1, keepdim=True)
        # A tensor divisor, not the number: CUDA torch divides by a Python scalar as a product
        # with its reciprocal (1 ulp off IEEE division at times), CPU torch and the Triton
        # kernel (div_rn) divide; the scale bytes must be one format on every device.
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    else:
        scale = torch.full((*x.shape[:-1], 1), float(static_scale), device=x.device)
    # Clamp first: torch's cast to e4m3fn turns out-of-range values into NaN, not +-448.
    values = (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 4] packed uint8 rows -> [..., head_dim] in ``dtype`` (new tensor)."""
    head_dim = unpacked_head_dim(packed)
    values = packed[..., :head_dim].view(FP8_DTYPE).float()  # a new, dense tensor
    scale = packed[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return values.mul_(scale).to(dtype)  # in place: 5x faster than a new product on CPU
