"""Batch-invariant linear layers and attention in Triton: ``model.deterministic`` on CUDA.

The CPU mode's reasoning (``kernels/batch_invariant.py``) with GPU kernels: a row's
result must depend on that row alone. cuBLAS picks its algorithm, tile and split-K by the
matrix sizes, so a row's bits change with the number of rows beside it; here every shape
is multiplied with one tile configuration:

- ``linear``: ``x [M, K] @ weight[N, K]^T (+ bias)``, one program per ``BLOCK_M x BLOCK_N``
  tile of the output, walking K in ``BLOCK_K`` steps with float32 accumulators, never
  split along K: an output element is the same sequence of ``tl.dot`` steps whatever M
  is, so it does not depend on the rows beside it.
- ``decode_fn``: the flash-decoding kernel (``kernels/triton_paged_decode.py``) with every
  context cut at multiples of ``SPLIT_TOKENS`` (not by the batch's longest) and each
  sequence's splits combined in order; ``kernels.batch_invariant.per_token_attention``
  sends every query token through it, a prefill's too.
- RMSNorm (one program per row), rotary, SiLU and the KV store of the Triton op set are
  row-local already.

Tested in Triton's interpreter on CPU (tests/kernels/test_triton_batch_invariant.py);
compiled on a GPU they run as written, with fixed ``num_warps``/``num_stages`` too (the
compiler then lays out every launch of a weight alike).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_paged_decode import launch_config, paged_decode_attention

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64
# Positions per context split: a multiple of every tile size the decode kernel uses.
SPLIT_TOKENS = 256


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the weight's rows, transposed by the indexing
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with one tile configuration for every shape: ``x``
    [..., K], ``weight`` [N, K] (rows contiguous), ``bias`` [N] -> [..., N] in x's dtype."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x {tuple(x.shape)} does not multiply weight {tuple(weight.shape)}"
        )
    if weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError("linear: weight rows must be contiguous and of x's dtype")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](
            x2, weight, bias if bias is not None else out, out, m, n, k,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=4, num_stages=2,
        )  # fmt: skip
    return out.reshape(*lead, n)


def decode_fn(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each query row over its own paged context (``kernels.batch_invariant.DecodeFn``):
    contexts cut at multiples of ``SPLIT_TOKENS``. The launch is sized by the block
    tables' width (an upper bound of every length: no device sync); splits past a
    sequence's end are empty and never combined."""
    block_n, _ = launch_config(query.dtype, query.is_cuda)
    if SPLIT_TOKENS % block_n:
        raise ValueError(f"SPLIT_TOKENS {SPLIT_TOKENS} is not a multiple of the tile {block_n}")
    max_seq_len = block_tables.shape[1] * kv_cache_layer.shape[3]
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    return paged_decode_attention(
        query, kv_cache_layer, block_tables, seq_lens, max_seq_len, scale,
        split_tokens=SPLIT_TOKENS,
    )  # fmt: skip
