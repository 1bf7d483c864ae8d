"""Mixture-of-Experts layer (Triton): (token, slot) pairs aligned to blocks, two grouped GEMMs.

Same signature and result as the reference, ``kernels/moe.py``, whose docstring has the
layouts: ``hidden`` [T, H]; ``w13`` [E, 2I, H] (gate over up); ``w2`` [E, H, I];
``topk_weights`` float32 [T, k]; ``topk_ids`` [T, k] global expert ids (int64 or int32);
expert ``first_expert + e`` is row ``e``, any other expert contributes nothing. Float32,
bfloat16 or float16 activations and weights (one dtype), any strides; the output is a new
contiguous [T, H] in ``hidden``'s dtype. Pair ``p`` of the flattened ``topk_ids`` is
token ``p // k``, slot ``p % k``.

Three steps (the vLLM / SGLang ``fused_moe`` structure):

1. ``align_pairs`` (PyTorch, no host sync, so the launch needs no ``.item()``): the pairs
   held here sorted by expert, each expert's run padded to a multiple of ``BLOCK_M`` with the
   sentinel pair id ``T * k``, so that every block of ``BLOCK_M`` sorted slots belongs to one
   expert (``block_experts``; -1 for the unused tail of the worst-case-sized buffer).
2. ``_moe_gate_up_kernel``, grid (block, tile of ``BLOCK_N`` intermediate columns): the
   block's token rows gathered from ``hidden`` times its expert's gate *and* up columns (two
   float32 accumulators), then SiLU-and-multiply in registers, written to ``intermediate``
   [T * k, I] at the pair's row: the [*, 2I] gate-up product never reaches memory.
3. ``_moe_down_kernel``, grid (block, tile of ``BLOCK_N`` hidden columns): the block's
   intermediate rows times ``w2[e].T``, times the pair's routing weight, written to
   ``pair_out`` float32 [T * k, H] at the pair's row (pairs held elsewhere stay 0). The k
   slots are then summed in PyTorch in slot order: no atomics, so the result is
   deterministic (atomic adds would order a token's k contributions by program timing).

Roundings follow the reference: the gate-up product is rounded to the input dtype, SiLU is
rounded, then the product; the down product is rounded before the float32 weighting and
sum, and the sum is rounded once at the end. Programs walk the experts' blocks first (axis 0),
so consecutive programs share an expert's weight tile in L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    intermediate_ptr,
    num_pairs,
    hidden_size,
    intermediate_size,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    TOP_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:  # past the last expert's padded run: nothing to do
        return
    pair_ids = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pair_ids < num_pairs  # padding slots hold num_pairs
    token_ids = (pair_ids // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < intermediate_size
    gate_ptrs = w13_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    up_ptrs = gate_ptrs + intermediate_size * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden_size
        x = tl.load(
            hidden_ptr + token_ids[:, None] * stride_hm + offs_k[None, :] * stride_hk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        mask_kn = mask_k[:, None] & mask_n[None, :]
        w_offs = offs_k[:, None] * stride_wk
        w_gate = tl.load(gate_ptrs + w_offs, mask=mask_kn, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(up_ptrs + w_offs, mask=mask_kn, other=0.0)
        acc_gate += tl.dot(x, w_gate, input_precision=DOT_PRECISION)
        acc_up += tl.dot(x, w_up, input_precision=DOT_PRECISION)
    dtype = intermediate_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out_ptrs = (
        intermediate_ptr + pair_ids[:, None].to(tl.int64) * intermediate_size + offs_n[None, :]
    )
    tl.store(out_ptrs, (silu * up).to(dtype), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(
    intermediate_ptr,
    w2_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    pair_out_ptr,
    num_pairs,
    hidden_size,
    intermediate_size,
    stride_we,
    stride_wn,
    stride_wk,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pair_ids = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pair_ids < num_pairs
    rows = pair_ids.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden_size
    w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, intermediate_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < intermediate_size
        a = tl.load(
            intermediate_ptr + rows[:, None] * intermediate_size + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptrs + offs_k[:, None] * stride_wk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    weight = tl.load(topk_weights_ptr + rows, mask=mask_m, other=0.0)  # float32 [BLOCK_M]
    y = acc.to(intermediate_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    out_ptrs = pair_out_ptr + rows[:, None] * hidden_size + offs_n[None, :]
    tl.store(out_ptrs, y, mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and launch options of both GEMM kernels."""

    block_m: int  # sorted pairs per block (each expert's run is padded to a multiple)
    block_n: int  # output columns per program (kernel 1: gate and up columns each)
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 2


def launch_config(
    num_pairs: int, num_experts: int, dtype: torch.dtype, is_cuda: bool
) -> LaunchConfig:
    """The tiles for ``num_pairs`` (token, slot) pairs over ``num_experts`` local experts.

    CUDA: chosen offline for sm_90 (``python -m bench.gpu_kernels --compile-only``: registers
    and spills from ``cuobjdump``), not yet timed on a GPU. Few pairs per expert (decode):
    16-row blocks, since each expert's run is padded to a whole block and the weights are
    read once per block whatever its height; prefill: 64-row blocks for operand reuse.
    float32 ("ieee" dots on FMA units) keeps small tiles. The interpreter: small tiles keep
    its per-op arrays small.
    """
    if not is_cuda:
        return LaunchConfig(16, 32, 32, 4, 1)
    if dtype == torch.float32:
        return LaunchConfig(16 if num_pairs <= 16 * num_experts else 32, 32, 32, 4, 2)
    if num_pairs <= 16 * num_experts:
        return LaunchConfig(16, 64, 128, 4, 3)
    return LaunchConfig(64, 128, 64, 8, 3)


def align_pairs(
    topk_ids: torch.Tensor, first_expert: int, num_local_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block layout of step 1 (module docstring), computed on ``topk_ids``' device
    without a host sync; mutates nothing.

    Returns ``(sorted_pair_ids, block_experts)``: int32 [num_blocks * block_m] pair ids,
    each expert's held pairs in token order and padded with ``topk_ids.numel()``; int32
    [num_blocks] the local expert of each block, -1 past the last expert's run.
    ``num_blocks = ceil(P / block_m) + E`` bounds the padded total (P pairs, E experts).
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    local = topk_ids.flatten().long() - first_expert
    held = (local >= 0) & (local < num_local_experts)
    keys = torch.where(held, local, num_local_experts)  # experts held elsewhere sort last
    sorted_keys, order = torch.sort(keys, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    counts = counts[:num_local_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    num_blocks = triton.cdiv(num_pairs, block_m) + num_local_experts
    capacity = num_blocks * block_m
    # Sorted pair j of expert e goes to its run's start plus its rank; pairs held elsewhere
    # to a dump slot past the end, cut off below.
    expert_of = sorted_keys.clamp(max=num_local_experts - 1)
    rank = torch.arange(num_pairs, device=device) - starts[expert_of]
    dest = torch.where(
        sorted_keys < num_local_experts, padded_ends[expert_of] - padded[expert_of] + rank, capacity
    )
    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_local_experts, block_experts, -1)
    return sorted_pair_ids[:capacity], block_experts.to(torch.int32)


def _check_inputs(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"fused_moe: want hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], got "
            f"{tuple(hidden.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, _ = w13.shape
    if two_i % 2 or w13.shape[2] != hidden_size or w2.shape != (num_local, hidden_size, two_i // 2):
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden "
            f"size {hidden_size} (want [E, 2I, H] and [E, H, I])"
        )
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"fused_moe: hidden must be float32, bfloat16 or float16, not {hidden.dtype}"
        )
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(
            f"fused_moe: w13 ({w13.dtype}) and w2 ({w2.dtype}) must be hidden's dtype {hidden.dtype}"
        )
    if (
        topk_ids.dim() != 2
        or topk_ids.shape[0] != num_tokens
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [{num_tokens}, top_k]"
        )
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fused_moe: topk_ids must be int64 or int32, not {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"fused_moe: topk_weights must be float32, not {topk_weights.dtype}")
    for name, t in (
        ("w13", w13),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
    ):
        if t.device != hidden.device:
            raise ValueError(f"fused_moe: {name} on {t.device}, hidden on {hidden.device}")


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Each token's weighted sum over its top-k experts held here (``kernels/moe.py``):
    a new [T, H] tensor in ``hidden``'s dtype; mutates nothing. ``config``: the tiles
    (default ``launch_config``'s)."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, _ = w13.shape
    intermediate_size = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or num_local == 0 or hidden_size == 0 or intermediate_size == 0:
        return torch.zeros_like(hidden, memory_format=torch.contiguous_format)
    if config is None:
        config = launch_config(num_pairs, num_local, hidden.dtype, hidden.is_cuda)
    sorted_pair_ids, block_experts = align_pairs(topk_ids, first_expert, num_local, config.block_m)
    num_blocks = block_experts.shape[0]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    tiles = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k)

    intermediate = torch.empty(
        num_pairs, intermediate_size, dtype=hidden.dtype, device=hidden.device
    )
    grid = (num_blocks, triton.cdiv(intermediate_size, config.block_n))
    _moe_gate_up_kernel[grid](
        hidden, w13, sorted_pair_ids, block_experts, intermediate,
        num_pairs, hidden_size, intermediate_size,
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        TOP_K=top_k, DOT_PRECISION=precision, **tiles, **launch,
    )  # fmt: skip

    # Zeros: the rows of pairs held elsewhere are never written and add nothing below.
    pair_out = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    grid = (num_blocks, triton.cdiv(hidden_size, config.block_n))
    _moe_down_kernel[grid](
        intermediate, w2, topk_weights.contiguous(), sorted_pair_ids, block_experts, pair_out,
        num_pairs, hidden_size, intermediate_size, w2.stride(0), w2.stride(1), w2.stride(2),
        DOT_PRECISION=precision, **tiles, **launch,
    )  # fmt: skip
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
