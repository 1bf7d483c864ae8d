"""INT4 weight-only linear layers: the dequantize-then-matmul reference and the CPU kernel.

The quantized weight, in the unpacked form every reader produces (``workers/models/quant``):

- ``q`` uint8 [out_features, in_features], values 0..15;
- ``scales`` float [out_features, num_groups] and ``zeros`` float [out_features,
  num_groups], the zero points (integers 0..15; 8 for symmetric quantization), where
  input column ``k`` belongs to group ``k // group_size`` and the last group may be short;
- the weight it stands for: ``w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]``.

The reference (``dequantize``, ``int4_linear_reference``) computes exactly that, in float32,
and is what every kernel is tested against.

CPU kernel: torch's ``_weight_int4pack_mm_for_cpu`` (ATen, AVX-512/AVX2), which reads half a
byte per weight. Its packed weight is ``_convert_weight_to_int4pack_for_cpu(q)`` (uint8
[N, K / 2]) and its per-group parameters a [num_groups, N, 2] tensor of (scale, zero) in
the *activation* dtype that it applies as ``(q - 8) * scale + zero``: ours, rewritten, is
``zero = (8 - zero_point) * scale``. It needs ``N % 16 == 0`` and ``K % group_size == 0``
(``cpu_kernel_supported``). It is fast only for bfloat16 activations (float32 takes a
generic path ~40x slower, measured in torch 2.13 on the dev VM), so ``int4_linear_cpu``
casts float32 activations to bfloat16 and the result back: the activations lose their low
16 mantissa bits, which the 4-bit weights' error dwarfs (measured in bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT4_CPU_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU kernel accepts


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight [N, K] that ``q``/``scales``/``zeros`` stand for (reference)."""
    k = q.shape[1]
    scale = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    zero = zeros.float().repeat_interleave(group_size, dim=1)[:, :k]
    return (q.float() - zero) * scale


def int4_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` by the dequantized weight, in float32; result in ``x``'s dtype."""
    weight = dequantize(q, scales, zeros, group_size)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def cpu_kernel_supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether ``int4_linear_cpu`` takes this shape (else keep a dequantized weight)."""
    ops = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")
    return (
        all(hasattr(torch.ops.aten, op) for op in ops)
        and group_size in INT4_CPU_GROUP_SIZES
        and out_features % 16 == 0
        and in_features % group_size == 0
    )


@dataclass(frozen=True)
class Int4CpuMatmul:
    """The ``matmul(x, weight, bias)`` of a linear layer whose ``weight`` is the packed
    int4 tensor from ``pack_cpu``; holds the per-group (scale, zero) pairs."""

    scale_zeros: torch.Tensor  # [num_groups, N, 2] bfloat16
    group_size: int

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return int4_linear_cpu(x, packed, self.scale_zeros, self.group_size, bias)


def pack_cpu(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, Int4CpuMatmul]:
    """(packed weight, its matmul) for the CPU kernel; ``cpu_kernel_supported`` must hold."""
    n, k = q.shape
    if not cpu_kernel_supported(n, k, group_size):
        raise ValueError(f"the CPU int4 kernel does not take [{n}, {k}] in groups of {group_size}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scale = scales.float()
    zero = (8.0 - zeros.float()) * scale
    scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, Int4CpuMatmul(scale_zeros, group_size)


def int4_linear_cpu(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [..., K] times the packed int4 weight [N, K] (+ bias) -> [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scale_zeros)
    out = out.to(x.dtype).reshape(*lead, out.shape[-1])
    if bias is not None:
        out = out + bias
    return out
