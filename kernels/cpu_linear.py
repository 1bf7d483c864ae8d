"""Linear layers on CPU through oneDNN, with each weight packed once at load.

Why: torch's float32 ``F.linear`` on CPU calls MKL's sgemm, which on the development VM
(AMD EPYC, AVX-512, 2 threads) runs the model's shapes at 8-186 GFLOP/s, slowest at 2-3
rows. oneDNN's inner product over a weight reordered once into its blocked layout runs the
same shapes 2.3-8.9x faster, up to 436 GFLOP/s (`bench/linear.py`, bench/RESULTS.md), and
a step of the engine is mostly these matmuls. The reorder is done once per weight, so no call pays for it.

Layout: ``weight`` is [out_features, in_features], as ``F.linear`` takes it. ``pack``
returns an opaque oneDNN tensor of the same shape and dtype (``is_mkldnn``): ``linear``
multiplies by it, ``to_dense()`` gives the weight back, and most other tensor ops
(indexing, ``torch.equal``, ``copy_``) refuse it. ``x`` is [..., in_features] (any
strides); the result is [..., out_features], strided.

The ops are torch's own oneDNN bindings (``torch.ops.mkldnn``, in every x86 build).
``packing_supported`` checks once per dtype that they exist, are enabled, and agree with
``F.linear`` here; where they do not (no oneDNN, or float16 without AVX512-FP16), the
caller keeps ``F.linear``.

Which is faster depends on the CPU, not on its vendor's name: on the AMD VM above packing
wins everywhere; on an Intel VM of the same project a whole decode step of SmolLM2-135M was
1.47x faster at one stream with ``F.linear`` and 1.1x slower batched. So
``measure_packing`` times both on the model's own weight at start-up and the loader keeps
the winner (and logs both timings).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.timing import fastest


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Return ``weight`` [out, in] reordered into oneDNN's layout (a new tensor)."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"pack expects a 2-D CPU weight, got shape {tuple(weight.shape)} on {weight.device}"
        )
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack(weight)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_bf16(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear`` with ``packed = pack(weight.bfloat16())``: ``x`` rounded to bfloat16 for
    the multiply, the result back in ``x``'s dtype (half the weight bytes of float32)."""
    out = linear(x.to(torch.bfloat16), packed, None if bias is None else bias.bfloat16())
    return out.to(x.dtype)


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether ``pack``/``linear`` work for ``dtype`` on this CPU and match ``F.linear``
    (whether they are also faster is ``measure_packing``'s question)."""
    ops = ("_reorder_linear_weight", "_linear_pointwise")
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if not all(hasattr(torch.ops.mkldnn, op) for op in ops):
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 40, generator=gen).to(dtype)
    try:
        with torch.inference_mode():
            got = linear(x, pack(weight), bias)
    except (RuntimeError, AttributeError):  # no kernel for this dtype on this CPU
        return False
    want = F.linear(x, weight, bias)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@dataclass(frozen=True)
class PackingChoice:
    """What ``measure_packing`` found: seconds per call at 1 and at ``rows`` rows."""

    rows: int
    plain_s: tuple[float, float]  # F.linear at (1, rows)
    packed_s: tuple[float, float]  # oneDNN over the packed weight at (1, rows)

    @property
    def use_packed(self) -> bool:
        """Packed when it costs less summed over both row counts, each weighted by its
        own plain time (a decode step at one row counts as much as a batched one)."""
        return sum(p / f for p, f in zip(self.packed_s, self.plain_s, strict=True)) < 2.0

    def describe(self) -> str:
        us = [f"{s * 1e6:.0f}" for s in (*self.plain_s, *self.packed_s)]
        return (
            f"F.linear {us[0]} / {us[1]} us, oneDNN packed {us[2]} / {us[3]} us "
            f"at 1 / {self.rows} rows"
        )


def measure_packing(weight: torch.Tensor, rows: int = 32, repeats: int = 7) -> PackingChoice:
    """Time ``F.linear`` against oneDNN over ``pack(weight)`` on this machine, at one row
    and at ``rows`` rows (the minimum of ``repeats`` rounds, the two alternating); a few
    milliseconds for a model's largest linear. Requires ``packing_supported``."""
    packed = pack(weight)
    gen = torch.Generator().manual_seed(0)
    one, many = (torch.randn(n, weight.shape[1], generator=gen).to(weight.dtype) for n in (1, rows))
    with torch.inference_mode():
        plain_1, packed_1, plain_n, packed_n = fastest(
            [
                lambda: F.linear(one, weight),
                lambda: linear(one, packed),
                lambda: F.linear(many, weight),
                lambda: linear(many, packed),
            ],
            repeats,
            inner=3,
        )
    return PackingChoice(rows, (plain_1, plain_n), (packed_1, packed_n))
