"""INT4 weight-only quantization: round-to-nearest quantizer, GPTQ and AWQ (GEMM) layouts.

Every reader turns a published layout into the unpacked form the kernels take
(``kernels/int4_linear.py``): ``q`` uint8 [out, in] (0..15), ``scales`` and ``zeros``
float32 [out, num_groups], ``w = (q - zeros) * scales`` per group of ``group_size`` input
columns. The layouts, as AutoGPTQ / GPTQModel and AutoAWQ write them (``Linear`` weight
``W`` is [out, in]):

- GPTQ: ``qweight`` int32 [in / 8, out], eight 4-bit values packed along the *input* dim
  (value ``j`` of word ``i`` is ``q[:, 8 i + j]`` at bits ``4 j``); ``qzeros`` int32
  [num_groups, out / 8], packed along the output dim the same way; ``scales`` float16
  [num_groups, out]; ``g_idx`` int32 [in], the group of each input column (``k //
  group_size`` unless the checkpoint was quantized with ``desc_act``). The v1 format
  (``checkpoint_format: gptq``, the default) stores each zero point minus one, so a zero
  point of 0 cannot be written (it wraps to 16 on reading); ``gptq_v2`` stores it as is.
- AWQ, GEMM version: ``qweight`` int32 [in, out / 8], packed along the *output* dim in
  the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (bits ``4 i`` of a word hold output
  column ``8 c + order[i]``); ``qzeros`` int32 [num_groups, out / 8], same packing, zero
  points as is; ``scales`` float16 [num_groups, out].

Our quantizer (round to nearest, per group) keeps every zero point in 1..15 so that its
output is exact in every layout (v1 GPTQ included) and rounds scales to float16 as the
layouts store them: quantizing on load and loading a checkpoint quantized here give the
same weights, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Int4Weight:
    """One linear layer's weight in the unpacked form (see the module docstring)."""

    q: torch.Tensor  # uint8 [out, in], 0..15
    scales: torch.Tensor  # float32 [out, num_groups]
    zeros: torch.Tensor  # float32 [out, num_groups], zero points
    group_size: int


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def quantize(weight: torch.Tensor, group_size: int, symmetric: bool) -> Int4Weight:
    """Round-to-nearest 4-bit quantization of ``weight`` [out, in] per group of inputs.

    Symmetric: zero point 8, scale = max|w| / 7 (so -8 is never used, as GPTQ's sym).
    Asymmetric: scale = (max - min) / 15 over the group (with 0 inside the range), zero
    point = round(-min / scale) kept in 1..15 (see the module docstring).
    """
    out_features, in_features = weight.shape
    groups = num_groups(in_features, group_size)
    padded = torch.zeros(out_features, groups * group_size, dtype=torch.float32)
    padded[:, :in_features] = weight.float()
    w = padded.view(out_features, groups, group_size)
    if symmetric:
        scale = w.abs().amax(dim=-1) / 7
        zero = torch.full_like(scale, 8.0)
    else:
        w_max = w.amax(dim=-1).clamp(min=0)
        w_min = w.amin(dim=-1).clamp(max=0)
        scale = (w_max - w_min) / 15
    scale = scale.clamp(min=1e-8).half().float()  # stored as float16 by every layout
    if not symmetric:
        zero = torch.round(-w_min / scale).clamp(1, 15)
    q = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15)
    q = q.view(out_features, -1)[:, :in_features].to(torch.uint8)
    return Int4Weight(q.contiguous(), scale.contiguous(), zero.contiguous(), group_size)


# ---- packing ------------------------------------------------------------------------------
def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] of 0..15 -> int32 [R / 8, C]: value j of word i is row 8 i + j (GPTQ qweight)."""
    rows, cols = values.shape
    if rows % 8:
        raise ValueError(f"cannot pack {rows} rows in words of 8")
    v = values.to(torch.int32).view(rows // 8, 8, cols)
    return (v << _SHIFTS[None, :, None]).sum(dim=1, dtype=torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_rows``: int32 [R / 8, C] -> uint8 [R, C]."""
    words, cols = packed.shape
    v = (packed.to(torch.int32)[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return v.reshape(words * 8, cols).to(torch.uint8)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] of 0..15 -> int32 [R, C / 8]: bits 4 i of word c hold column 8 c + order[i]."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"cannot pack {cols} columns in words of 8")
    v = values.to(torch.int32).view(rows, cols // 8, 8)[:, :, list(order)]
    return (v << _SHIFTS).sum(dim=-1, dtype=torch.int32)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Inverse of ``pack_cols``: int32 [R, C / 8] -> uint8 [R, C]."""
    rows, words = packed.shape
    nibbles = (packed.to(torch.int32)[:, :, None] >> _SHIFTS) & 0xF  # [R, C/8, 8] by nibble
    v = torch.empty_like(nibbles)
    v[:, :, list(order)] = nibbles
    return v.reshape(rows, words * 8).to(torch.uint8)


# ---- GPTQ ---------------------------------------------------------------------------------
def to_gptq(w: Int4Weight, v1: bool = True) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of one layer (``qweight``, ``qzeros``, ``scales``, ``g_idx``)."""
    in_features = w.q.shape[1]
    zeros = w.zeros.t().to(torch.int32) - (1 if v1 else 0)  # [num_groups, out]
    return {
        "qweight": pack_rows(w.q.t()),
        "qzeros": pack_cols(zeros & 0xF),
        "scales": w.scales.t().half().contiguous(),
        "g_idx": torch.arange(in_features, dtype=torch.int32) // w.group_size,
    }


def from_gptq(
    tensors: dict[str, torch.Tensor], group_size: int, in_features: int, v1: bool = True
) -> Int4Weight:
    """One layer's GPTQ tensors -> Int4Weight; ValueError on a shape that does not fit or
    an act-order ``g_idx`` (input columns not in consecutive groups: not supported)."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    groups = num_groups(in_features, group_size)
    out_features = qweight.shape[1]
    _expect("qweight", qweight, (-(-in_features // 8), out_features))
    _expect("qzeros", qzeros, (groups, -(-out_features // 8)))
    _expect("scales", scales, (groups, out_features))
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        in_order = torch.arange(in_features, dtype=torch.int32) // group_size
        if not torch.equal(g_idx.to(torch.int32), in_order):
            raise ValueError(
                "GPTQ g_idx is not k // group_size (desc_act / act-order checkpoints are not "
                "supported)"
            )
    q = unpack_rows(qweight)[:in_features].t()
    zeros = unpack_cols(qzeros)[:, :out_features].float() + (1 if v1 else 0)
    return Int4Weight(
        q.contiguous(), scales.float().t().contiguous(), zeros.t().contiguous(), group_size
    )


# ---- AWQ (GEMM) ---------------------------------------------------------------------------
def to_awq(w: Int4Weight) -> dict[str, torch.Tensor]:
    """The AWQ GEMM tensors of one layer (``qweight``, ``qzeros``, ``scales``)."""
    return {
        "qweight": pack_cols(w.q.t(), AWQ_ORDER),
        "qzeros": pack_cols(w.zeros.t().to(torch.int32), AWQ_ORDER),
        "scales": w.scales.t().half().contiguous(),
    }


def from_awq(tensors: dict[str, torch.Tensor], group_size: int) -> Int4Weight:
    """One layer's AWQ GEMM tensors -> Int4Weight; ValueError on a shape that does not fit."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = num_groups(in_features, group_size)
    _expect("qzeros", qzeros, (groups, qweight.shape[1]))
    _expect("scales", scales, (groups, out_features))
    q = unpack_cols(qweight, AWQ_ORDER).t()
    zeros = unpack_cols(qzeros, AWQ_ORDER).float().t()
    return Int4Weight(
        q.contiguous(), scales.float().t().contiguous(), zeros.contiguous(), group_size
    )


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, found {tuple(tensor.shape)}")
