"""Rotary position embedding (plain-PyTorch reference), Hugging Face ``rotate_half`` convention.

Layouts:
    cos_sin_cache: [max_position, rotary_dim]; row ``p`` is ``cat(cos(p * inv_freq),
                   sin(p * inv_freq))``, each half rotary_dim // 2 wide
    q:             [num_tokens, num_heads, head_dim]
    k:             [num_tokens, num_kv_heads, head_dim]
    positions:     [num_tokens] int64

The first ``rotary_dim`` features of each head are rotated as two halves (the "neox"
layout used by Hugging Face Llama/Qwen/Mistral); features past ``rotary_dim`` pass through.

Scaling (``rope_scaling["rope_type"]``, or the older key ``"type"``): ``default``,
``linear`` (divide frequencies by ``factor``), ``llama3`` (Llama 3.1's piecewise
frequency rescaling) and ``yarn`` (NTK-by-parts interpolation, DeepSeek-V2/V3 and Qwen's
long-context configs; its attention factor multiplies the cos/sin table, as Hugging Face
does). Frequencies are computed in float32 as Hugging Face does, then the cache is cast
to the model dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)  # [rotary_dim // 2] float32
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, base, rope_scaling)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
    # and the band in between interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """What multiplies the cos/sin table: YaRN's ``attention_factor`` (given, or from
    ``factor`` and DeepSeek's ``mscale`` / ``mscale_all_dim``, as Hugging Face derives it);
    1 for every other rope type."""
    if rope_scaling is None:
        return 1.0
    if rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling["factor"]
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def _yarn_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any]) -> torch.Tensor:
    factor = rope_scaling["factor"]
    original_len = rope_scaling["original_max_position_embeddings"]
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength makes num_rotations turns over original_len.
        return (rotary_dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    exponents = torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim
    pos_freqs = base**exponents
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)
    # 1: keep the trained frequency (high frequencies), 0: interpolate by factor.
    extrapolation = 1 - torch.clamp(ramp, 0, 1)
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def compute_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Build the [max_position, rotary_dim] cos/sin table (on the current default device).

    Raises ValueError naming an unsupported ``rope_type``.
    """
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = _inv_freq(rotary_dim, base, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim // 2]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    factor = rope_attention_factor(rope_scaling)
    return (cache if factor == 1.0 else cache * factor).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, rotary_dim // 2]
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rotated copies of ``q`` [T, Hq, D] and ``k`` [T, Hk, D]; inputs are not mutated."""
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)  # [T, rotary_dim]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim // 2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
