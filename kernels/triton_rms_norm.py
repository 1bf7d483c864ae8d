"""RMSNorm and residual-add + RMSNorm (Triton).

Layouts (same as the reference, ``kernels/rms_norm.py``): ``x`` and ``residual`` are
[..., hidden_size] with a contiguous last dim (e.g. [num_tokens, hidden_size], or the
per-head q/k norm's [num_tokens, num_heads, head_dim] view into the qkv output, whose token
stride is the qkv width); ``weight`` is [hidden_size] in the same dtype. Outputs are new
contiguous tensors of ``x``'s shape; no input is mutated.

The kernel sees the input as rows of ``hidden_size`` addressed by two strides (an outer and
an inner leading dim), so those strided views need no copy. One program normalises one row
in a single tile (hidden sizes up to 64k). Numerics match Hugging Face ``LlamaRMSNorm``:
the add is rounded to the input dtype (as ``x + residual`` in PyTorch), the mean of squares
and the scaling run in float32, the result is rounded to the input dtype and only then
multiplied by ``weight`` (one rounding, as PyTorch's elementwise product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    inner_size,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    HIDDEN_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_size
    inner = row % inner_size
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN_SIZE
    x = tl.load(
        x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0
    )
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols
        residual = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * HIDDEN_SIZE + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    variance = tl.sum(hidden * hidden, 0) / HIDDEN_SIZE
    normed = (hidden * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * HIDDEN_SIZE + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """View ``x`` [..., H] as [outer, inner, H]; returns (view, inner_size, outer/inner strides).

    Leading dims beyond two are merged by ``reshape`` (a copy only when they cannot be).
    """
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x, x.shape[1], x.stride(0), x.stride(1)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    name = "fused_add_rms_norm" if residual is not None else "rms_norm"
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or weight.dtype != x.dtype:
        raise ValueError(
            f"{name}: weight {tuple(weight.shape)} {weight.dtype} must be [{hidden_size}] {x.dtype}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{name}: residual {tuple(residual.shape)} {residual.dtype} != x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    if (
        x.stride(-1) != 1
        or weight.stride(0) != 1
        or (residual is not None and residual.stride(-1) != 1)
    ):
        raise ValueError(f"{name}: the last dim of x, residual and weight must be contiguous")
    if hidden_size > 65536:
        raise ValueError(f"{name}: hidden size {hidden_size} exceeds the one-tile limit 65536")
    devices = {t.device for t in (x, weight, *(() if residual is None else (residual,)))}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on several devices {devices}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual_out is None and residual is not None:
        residual_out = torch.empty_like(out)
    for tensor in (out, residual_out):
        if tensor is not None and (
            tensor.shape != x.shape or tensor.dtype != x.dtype or not tensor.is_contiguous()
        ):
            raise ValueError(f"{name}: outputs must be contiguous {tuple(x.shape)} {x.dtype}")
    num_rows = x.numel() // hidden_size if hidden_size else 0
    if num_rows == 0:
        return out, residual_out
    x_rows, inner_size, stride_x_outer, stride_x_inner = _as_rows(x)
    r_rows, stride_r_outer, stride_r_inner = x_rows, 0, 0
    if residual is not None:
        r_rows, r_inner_size, stride_r_outer, stride_r_inner = _as_rows(residual)
        if r_inner_size != inner_size:  # cannot happen for equal shapes; kept as a guard
            raise ValueError(f"{name}: residual layout does not match x")
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x_rows,
        r_rows,
        weight,
        out,
        residual_out if residual_out is not None else out,
        eps,
        inner_size,
        stride_x_outer,
        stride_x_inner,
        stride_r_outer,
        stride_r_inner,
        HIDDEN_SIZE=hidden_size,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Return ``weight * x / sqrt(mean(x**2) + eps)`` over the last dim; ``x`` is not mutated.

    Writes into ``out`` (contiguous, ``x``'s shape) when given.
    """
    result, _ = _launch(x, None, weight, eps, out, None)
    return result


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)`` in one pass; no input is mutated.

    Writes into ``out`` / ``residual_out`` (contiguous, ``x``'s shape) when given.
    """
    result, new_residual = _launch(x, residual, weight, eps, out, residual_out)
    assert new_residual is not None
    return result, new_residual
