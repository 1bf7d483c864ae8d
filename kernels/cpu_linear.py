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
caller keeps ``F.linear``. The speed-up was measured on the AMD CPU above only; MKL is
Intel's library, and on Intel CPUs the two should be closer (not measured).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether ``pack``/``linear`` work for ``dtype`` on this CPU and match ``F.linear``."""
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
