"""FP8 (float8_e4m3fn) weights: the published layouts, a quantizer, and the dequantizer.

Layouts read (``Linear`` weight ``W`` [out, in] stored as float8_e4m3fn, ``w = fp8 * s``):

- Hugging Face ``quant_method: fp8`` with ``weight_block_size: [bo, bi]`` (DeepSeek-V3 /
  Qwen3-FP8 style): ``weight_scale_inv`` float32 [ceil(out / bo), ceil(in / bi)], one
  scale per block (despite the name, it multiplies: it is the inverse of the quantizer's
  scale-down factor).
- ``quant_method: fp8`` without a block size (vLLM / AutoFP8 per-tensor): ``weight_scale``
  float32, one value ([] or [1]); an ``input_scale`` may sit beside it.
- compressed-tensors ``format: float-quantized``: ``weight_scale`` [out, 1] (strategy
  ``channel``) or [1] (``tensor``); an ``input_scale`` means static activation scales.

Activations are not quantized here: every ``input_scale`` is ignored (dynamic / weight-only
execution), and the weight is dequantized to the model dtype when it is loaded. Why: the
CPU has no FP8 matmul, and a per-step dequantization in PyTorch would cost more than the
weight bytes it saves; on CUDA the same path keeps one code path (no FP8 GEMM yet). The
model computes with exactly the values FP8 can hold; it does not save memory.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, ``weight_scale_inv`` [ceil(out/bo), ceil(in/bi)]) per block of ``block``."""
    out_features, in_features = weight.shape
    bo, bi = block
    rows, cols = -(-out_features // bo), -(-in_features // bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32)
    padded[:out_features, :in_features] = weight.float()
    blocks = padded.view(rows, bo, cols, bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:out_features, :in_features]
    return q.to(FP8).contiguous(), scale.contiguous()


def quantize_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, ``weight_scale`` [out, 1]) with one scale per output channel."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (weight.float() / scale).to(FP8).contiguous(), scale.contiguous()


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """The float32 weight that fp8 ``weight`` [out, in] and its ``scale`` stand for.

    ``block``: the block shape of a per-block scale; None for a per-tensor ([] or [1]) or
    per-channel ([out, 1]) scale. ValueError when the scale's shape does not fit.
    """
    if weight.dtype != FP8:
        raise ValueError(f"expected a float8_e4m3fn weight, found {weight.dtype}")
    w = weight.float()
    out_features, in_features = w.shape
    scale = scale.float()
    if block is not None:
        bo, bi = block
        want = (-(-out_features // bo), -(-in_features // bi))
        if tuple(scale.shape) != want:
            raise ValueError(f"weight_scale_inv: expected shape {want}, found {tuple(scale.shape)}")
        full = scale.repeat_interleave(bo, 0)[:out_features].repeat_interleave(bi, 1)
        return w * full[:, :in_features]
    if scale.numel() == 1:
        return w * scale.reshape(())
    if tuple(scale.shape) in ((out_features, 1), (out_features,)):
        return w * scale.reshape(out_features, 1)
    raise ValueError(
        f"weight_scale: expected one value or [{out_features}, 1], found {tuple(scale.shape)}"
    )
