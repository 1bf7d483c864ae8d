"""SiLU-and-multiply, the gated MLP activation (Triton).

Layout (same as the reference, ``kernels/activation.py``): ``x`` is [..., 2 * intermediate_size]
with a contiguous last dim — the fused ``gate_up_proj`` output, gate in the first half, up in
the second. Returns ``silu(gate) * up``: a new contiguous [..., intermediate_size] tensor.

Grid: (row, column tile of BLOCK). Numerics follow PyTorch's ``F.silu(gate) * up``: the SiLU
runs in float32 and is rounded to the input dtype, then the product is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x_row,
    stride_o_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate_ptrs = x_ptr + row * stride_x_row + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    out = (silu * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o_row + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``; ``x`` is not mutated.

    Writes into ``out`` (contiguous [..., d], ``x``'s dtype) when given.
    """
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim of {tuple(x.shape)} must be even")
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul: the last dim of x must be contiguous")
    intermediate_size = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], intermediate_size)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif out.shape != out_shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"silu_and_mul: out must be contiguous {out_shape} {x.dtype}")
    if out.device != x.device:
        raise ValueError(f"silu_and_mul: out on {out.device}, x on {x.device}")
    rows = x.reshape(-1, x.shape[-1])  # a view for the usual [num_tokens, 2 * d] input
    num_rows = rows.shape[0]
    if num_rows == 0 or intermediate_size == 0:
        return out
    block = min(triton.next_power_of_2(intermediate_size), 1024)
    grid = (num_rows, triton.cdiv(intermediate_size, block))
    _silu_and_mul_kernel[grid](
        rows,
        out,
        intermediate_size,
        rows.stride(0),
        intermediate_size,
        BLOCK=block,
        num_warps=4,
    )
    return out
