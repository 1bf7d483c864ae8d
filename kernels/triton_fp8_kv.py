"""The FP8 KV-cache format in Triton: load a tile of packed rows dequantized, quantize a row.

The format is ``kernels/fp8_kv.py``'s: each token row of a kv head is ``head_dim``
float8_e4m3fn bytes followed by their float32 scale (the cache tensor is ``uint8``). The
attention kernels (``triton_paged_decode``, ``triton_prefill_attention``) and the store
kernel (``triton_kv_store``) take an ``IS_FP8`` constexpr and call these helpers, so the
unquantized path compiles exactly as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_kv import FP8_MAX, MIN_SCALE, is_fp8_cache, unpacked_head_dim


@triton.jit
def load_kv_tile(row_ptrs, dims, mask, row_mask, HEAD_DIM: tl.constexpr, IS_FP8: tl.constexpr):
    """[N, HEAD_DIM_PAD] values of the N token rows starting at ``row_ptrs`` ([N] pointers):
    as stored, or (FP8) float32 ``fp8 * scale``. Masked elements are 0."""
    if IS_FP8:
        raw = tl.load(row_ptrs[:, None] + dims[None, :], mask=mask, other=0)
        scale_ptrs = (row_ptrs + HEAD_DIM).to(tl.pointer_type(tl.float32))
        scale = tl.load(scale_ptrs, mask=row_mask, other=0.0)
        tile = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    else:
        tile = tl.load(row_ptrs[:, None] + dims[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def quantize_rows(x, static_scale, HAS_STATIC_SCALE: tl.constexpr):
    """[R, D] rows -> (uint8 [R, D] FP8 bit patterns, float32 [R] scales), as the reference:
    scale ``amax / 448`` (at least MIN_SCALE) or ``static_scale``; values saturate at 448.
    Padding columns must be 0 (they do not raise amax)."""
    x32 = x.to(tl.float32)
    # div_rn: IEEE-rounded division, as torch's (a plain ``/`` may compile to an
    # approximate one on CUDA, and the bytes must be the reference's).
    if HAS_STATIC_SCALE:
        scale = tl.zeros([x.shape[0]], tl.float32) + static_scale
    else:
        amax = tl.max(tl.abs(x32), 1)
        scale = tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX_C), MIN_SCALE_C)
    scaled = tl.math.div_rn(x32, tl.broadcast_to(scale[:, None], x32.shape))
    scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX_C), FP8_MAX_C)
    return _to_e4m3_bits(scaled), scale


@triton.jit
def _to_e4m3_bits(x):
    """float32 in [-448, 448] -> float8_e4m3fn bit patterns (uint8), round to nearest even.

    By integer arithmetic on the float32 bits rather than ``x.to(tl.float8e4nv)``: Triton's
    interpreter (3.7.1) drops the carry when rounding up crosses a power of two (127.9 ->
    64, not 128), and the store must write the reference's bytes on every backend.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # Normal FP8 (|x| >= 2**-6): keep 3 of the 23 mantissa bits, rounding half to even; the
    # carry of a round-up runs into the exponent as it should. Rebias 127 -> 7.
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal FP8: multiples of 2**-9, rounded half to even (8 * 2**-9 is the smallest
    # normal, whose bits are 8 too).
    y = tl.abs(x) * 512.0
    floor = tl.floor(y)
    frac = y - floor
    is_odd = (floor.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & is_odd)
    subnormal = floor.to(tl.int32) + up.to(tl.int32)
    magnitude = tl.where(mag >= (121 << 23), normal, subnormal)  # 2**-6 = exponent 121
    return ((sign << 7) | magnitude).to(tl.uint8)


FP8_MAX_C = tl.constexpr(FP8_MAX)
MIN_SCALE_C = tl.constexpr(MIN_SCALE)


def check_cache(name: str, query: torch.Tensor, kv_cache_layer: torch.Tensor) -> tuple[bool, int]:
    """(is_fp8, head_dim) of a cache layer that an attention op reads for ``query``; raises
    ValueError naming the op when the cache's dtype fits neither format."""
    if is_fp8_cache(kv_cache_layer):
        return True, unpacked_head_dim(kv_cache_layer)
    if kv_cache_layer.dtype != query.dtype:
        raise ValueError(
            f"{name}: dtypes differ (query {query.dtype}, cache {kv_cache_layer.dtype})"
        )
    return False, kv_cache_layer.shape[4]
