"""INT4 weight-only linear layer (Triton): dequantize in registers, then ``tl.dot``.

The weight it stands for is the reference's (``kernels/int4_linear.py``): ``w[n, k] =
(q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]``. Layouts here:

- ``qweight`` int32 [ceil(K / 8), N]: eight 4-bit values packed along K (value ``j`` of
  word ``i`` is ``q[:, 8 i + j]`` at bits ``4 j``), the GPTQ order, so that a tile of
  BLOCK_K x BLOCK_N weights is BLOCK_K / 8 rows of contiguous words along N;
- ``scales``, ``zeros`` float32 [num_groups, N] (the last group may be short);
- ``x`` [M, K] (any strides, float32 / bfloat16 / float16) -> ``out`` [M, N] contiguous,
  in ``x``'s dtype, accumulated in float32; ``bias`` [N] optional.

One program computes a BLOCK_M x BLOCK_N tile of ``out``, walking K in BLOCK_K steps: it
loads the packed words once per tile, shifts out the nibbles, applies each column's
group (scale, zero) and multiplies the dequantized tile in ``x``'s dtype. Decode (small M)
is bound by reading the weight, a quarter of bfloat16's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_linear_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        mask_kn = mask_k[:, None] & mask_n[None, :]
        words = tl.load(
            qweight_ptr + (offs_k[:, None] // 8).to(tl.int64) * N + offs_n[None, :],
            mask=mask_kn,
            other=0,
        )  # [BLOCK_K, BLOCK_N] int32, each word read by its 8 rows
        q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        group = (offs_k // GROUP_SIZE)[:, None].to(tl.int64) * N + offs_n[None, :]
        scale = tl.load(scales_ptr + group, mask=mask_kn, other=0.0)
        zero = tl.load(zeros_ptr + group, mask=mask_kn, other=0.0)
        w = ((q.to(tl.float32) - zero) * scale).to(x_ptr.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def pack_weight(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (0..15) -> ``qweight`` int32 [ceil(K / 8), N] (see the docstring)."""
    n, k = q.shape
    padded = torch.zeros(-(-k // 8) * 8, n, dtype=torch.int32, device=q.device)
    padded[:k] = q.t().to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (padded.view(-1, 8, n) << shifts[None, :, None]).sum(dim=1, dtype=torch.int32)


@dataclass(frozen=True)
class TritonInt4Matmul:
    """The ``matmul(x, weight, bias)`` of a linear layer whose ``weight`` is ``pack_weight``'s."""

    scales: torch.Tensor  # float32 [num_groups, N]
    zeros: torch.Tensor  # float32 [num_groups, N]
    group_size: int
    in_features: int
    # model.deterministic: one tile height whatever the number of rows, so a row's sums
    # never depend on how many rows share its launch (kernels/triton_batch_invariant.py).
    block_m: int | None = None

    def __call__(
        self, x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return int4_linear(
            x, qweight, self.scales, self.zeros, self.group_size, self.in_features, bias,
            block_m=self.block_m,
        )  # fmt: skip


def pack(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, TritonInt4Matmul]:
    """(packed weight, its matmul) from the unpacked form ``q`` [N, K], ``scales``/``zeros``
    [N, num_groups] (``kernels/int4_linear.py``)."""
    matmul = TritonInt4Matmul(
        scales.float().t().contiguous(), zeros.float().t().contiguous(), group_size, q.shape[1]
    )
    return pack_weight(q), matmul


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """``x`` [..., K] times the int4 weight [N, K] (+ ``bias``) -> [..., N] in x's dtype.
    ``block_m``: rows per tile (default: by the number of rows)."""
    k = in_features
    n = qweight.shape[1]
    groups = -(-k // group_size)
    if x.shape[-1] != k:
        raise ValueError(f"int4_linear: x has {x.shape[-1]} input features, the weight {k}")
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (-(-k // 8), n):
        raise ValueError(
            f"int4_linear: qweight must be int32 [{-(-k // 8)}, {n}], got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float32 or tuple(t.shape) != (groups, n) or not t.is_contiguous():
            raise ValueError(f"int4_linear: {name} must be contiguous float32 [{groups}, {n}]")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"int4_linear: bias must be [{n}], got {tuple(bias.shape)}")
    if not qweight.is_contiguous():
        raise ValueError("int4_linear: qweight must be contiguous")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](
        x2,
        qweight,
        scales,
        zeros,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.reshape(*lead, n)
