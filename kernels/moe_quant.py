"""Quantized MoE expert weights, stacked per layer, and one expert's MLP over them.

A layer's experts are two stacks, ``w13`` ([E, 2I, H]: gate rows over up rows) and ``w2``
([E, H, I]), as in ``kernels/moe.py``; here each stack is quantized, one weight matrix
[N, K] per row ``e``:

- ``Int4CpuStack``: torch's CPU int4 kernel per expert (``kernels/int4_linear.py``,
  ``pack_cpu``): ``packed`` uint8 [E, N, K / 2] (that kernel's opaque layout) and
  ``scale_zeros`` bfloat16 [E, G, N, 2]; half a byte per weight plus 4 bytes per group.
  Multiplies without dequantizing (activations in bfloat16, as the dense int4 layers).
- ``Int4Stack``: the same quantized values in a plain layout, for the shapes that kernel
  does not take: ``nibbles`` uint8 [E, N, K / 2] (column ``2j`` in the low
  nibble, ``2j + 1`` in the high), ``scales`` / ``zeros`` float16 [E, N, G]; the expert's
  weight is dequantized when it runs.
- ``Fp8Stack``: ``weight`` float8_e4m3fn [E, N, K] and one float32 scale per output
  channel, ``scales`` [E, N]; dequantized when the expert runs (the CPU has no FP8 matmul).

Only the *active* experts of a step are dequantized (``grouped_moe`` calls ``mlp`` once
per expert that received tokens), never the whole stack. Every stack's ``tensors`` are
[E, ...] with row ``e`` the whole of expert ``e``: what the expert rebalancer copies
between ranks (``workers/models/expert_rebalance.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul
from kernels.int4_linear import int4_linear_cpu, pack_cpu


class QuantStack(Protocol):
    """One quantized stack of expert weights (module docstring)."""

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]: ...

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` [count, K] times expert ``expert``'s weight [N, K]^T -> [count, N]."""
        ...


@dataclass(frozen=True)
class Int4CpuStack:
    packed: torch.Tensor  # uint8 [E, N, K / 2], pack_cpu's layout per expert
    scale_zeros: torch.Tensor  # bfloat16 [E, G, N, 2]
    group_size: int

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
        """From the unpacked form: ``q`` uint8 [E, N, K], ``scales`` / ``zeros`` [E, N, G]."""
        parts = [pack_cpu(q[e], scales[e], zeros[e], group_size) for e in range(len(q))]
        packed = torch.stack([p for p, _ in parts])
        return cls(packed, torch.stack([m.scale_zeros for _, m in parts]), group_size)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scale_zeros

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return int4_linear_cpu(x, self.packed[expert], self.scale_zeros[expert], self.group_size)


@dataclass(frozen=True)
class Int4Stack:
    nibbles: torch.Tensor  # uint8 [E, N, ceil(K / 2)]
    scales: torch.Tensor  # float16 [E, N, G]
    zeros: torch.Tensor  # float16 [E, N, G], zero points 0..15
    group_size: int
    in_features: int  # K

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
        """From the unpacked form: ``q`` uint8 [E, N, K], ``scales`` / ``zeros`` [E, N, G]."""
        k = q.shape[-1]
        padded = F.pad(q, (0, k % 2))  # an odd K gets a zero high nibble
        nibbles = padded[..., 0::2] | (padded[..., 1::2] << 4)
        return cls(nibbles.contiguous(), scales.half(), zeros.half(), group_size, k)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.nibbles, self.scales, self.zeros

    def weight(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``expert``'s weight [N, K] in ``dtype``: ``(q - zero) * scale`` per group."""
        nib = self.nibbles[expert]
        n, k, g = nib.shape[0], self.in_features, self.group_size
        q = torch.stack([nib & 0xF, nib >> 4], dim=-1).view(n, -1)[:, :k].to(dtype)
        groups = self.scales.shape[-1]
        q = F.pad(q, (0, groups * g - k)).view(n, groups, g)
        zero = self.zeros[expert].to(dtype)[..., None]
        scale = self.scales[expert].to(dtype)[..., None]
        return ((q - zero) * scale).view(n, -1)[:, :k]

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(expert, x.dtype))


@dataclass(frozen=True)
class Fp8Stack:
    weight: torch.Tensor  # float8_e4m3fn [E, N, K]
    scales: torch.Tensor  # float32 [E, N], w = fp8 * scale per output channel

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.weight, self.scales

    def dequantize(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``expert``'s weight [N, K] in ``dtype``, exactly what FP8 holds.

        Not ``weight.float()``: torch's float8 -> float32 cast takes a scalar path on CPU
        (3.0 ms for a 512 x 768 expert, measured on the dev VM) where these integer ops
        take 0.8 ms. An e4m3 byte ``s eeee mmm`` (bias 7) moved to bits 31 and 26..20 of a
        float32 is the same number times 2^-120 (normals and subnormals alike), which the
        scale absorbs. (The format's NaN, never written by our quantizer, would read 480.)
        """
        b = self.weight[expert].view(torch.int8).to(torch.int32)  # sign-extended
        bits = ((b << 20) & -0x80000000) | ((b & 0x7F) << 20)
        w = bits.view(torch.float32) * (self.scales[expert] * 2.0**120)[:, None]
        return w.to(dtype)

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(expert, x.dtype))


@dataclass(frozen=True)
class QuantizedExperts:
    """A layer's quantized ``w13`` and ``w2`` stacks; ``mlp`` is ``grouped_moe``'s
    ``expert_mlp``. ``method``: "int4" or "fp8"; ``kernel``: how an expert multiplies
    ("int4-cpu" packed kernel, or "dequantize")."""

    w13: QuantStack
    w2: QuantStack
    method: str
    kernel: str

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.w13.tensors, *self.w2.tensors)

    @property
    def num_rows(self) -> int:
        """Expert rows held (experts and spare slots)."""
        return len(self.w13.tensors[0])

    def mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s ``w2 @ silu_and_mul(w13 @ x)`` for rows ``x`` [count, H]."""
        return self.w2.linear(expert, silu_and_mul(self.w13.linear(expert, x)))

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
