"""MoE expert weights quantized on load (``model.quantization: fp8 | int4`` on a plain MoE
checkpoint): each layer's stacked ``w13`` / ``w2`` become ``kernels/moe_quant.py`` stacks.

Runs after the checkpoint is loaded, on the experts this rank holds (under expert
parallelism, its own ``E / N``; the rebalancer's spare rows stay empty until a copy
arrives), so each rank quantizes only its own experts. The schemes are the dense ones'
where they carry over: INT4 asymmetric, round to nearest, groups of 128 input columns
(64 or 32 where 128 does not divide the width: the CPU kernel's sizes) with float16 scales,
``quant/int4.py``'s quantizer; FP8 e4m3 with one scale per output channel
(``quant/fp8.py``'s ``quantize_channel``), not per 128x128 block, so that dequantizing an
expert is one multiply per row. Unlike the dense FP8 layers, which are dequantized once at
load, the experts stay FP8 in memory and only the active ones are dequantized per step:
the experts are most of a MoE model's bytes, and few of them run in a step.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels.int4_linear import INT4_CPU_GROUP_SIZES, cpu_kernel_supported
from kernels.moe_quant import Fp8Stack, Int4CpuStack, Int4Stack, QuantizedExperts
from workers.models.quant import fp8, int4
from workers.models.quant.formats import ON_LOAD_GROUP_SIZE

logger = logging.getLogger(__name__)


def expert_group_size(widths: tuple[int, ...]) -> int:
    """The largest int4 group (128, 64, 32) dividing every input width, else 128 (the
    dequantizing stack takes a short last group)."""
    for size in sorted((g for g in INT4_CPU_GROUP_SIZES if g <= ON_LOAD_GROUP_SIZE), reverse=True):
        if all(w % size == 0 for w in widths):
            return size
    return ON_LOAD_GROUP_SIZE


def quantize_experts(model: nn.Module, method: str, device: torch.device, use_triton: bool) -> int:
    """Quantize every MoE layer's experts of ``model`` (modules with ``set_quantized``:
    ``workers/models/moe.py``'s ``FusedExperts``) to ``method``; mutates the model, frees
    the dense stacks. Returns how many layers were quantized."""
    layers = [m for m in model.modules() if hasattr(m, "set_quantized")]
    if layers and (use_triton or device.type != "cpu"):
        # The Triton fused MoE kernel reads dense weights, and the per-expert loop reads
        # its counts on the host, which a captured CUDA graph cannot; not run on a GPU.
        raise ValueError(
            f"quantization: {method} MoE experts run on CPU only for now (no quantized "
            f"fused MoE kernel for {device.type}); serve the checkpoint unquantized there"
        )
    kinds = set()
    for experts in layers:
        w13, w2 = experts.w13.data, experts.w2.data
        quantized = _quantize(w13, w2, experts.num_local_experts, method, device, use_triton)
        experts.set_quantized(quantized)
        kinds.add(quantized.kernel)
    if layers:
        logger.info("MoE experts: %s in %d layers (%s)", method, len(layers), ", ".join(kinds))
    return len(layers)


def _quantize(
    w13: torch.Tensor,
    w2: torch.Tensor,
    num_held: int,
    method: str,
    device: torch.device,
    use_triton: bool,
) -> QuantizedExperts:
    if method == "fp8":
        return QuantizedExperts(_fp8(w13, num_held), _fp8(w2, num_held), "fp8", "dequantize")
    if method != "int4":
        raise ValueError(f"MoE experts: no quantization {method!r} (fp8, int4)")
    group_size = expert_group_size((w13.shape[2], w2.shape[2]))
    parts = [_int4(w, num_held, group_size) for w in (w13, w2)]
    on_kernel = (
        device.type == "cpu"
        and not use_triton
        and all(cpu_kernel_supported(w.shape[1], w.shape[2], group_size) for w in (w13, w2))
    )
    if on_kernel:  # torch's CPU int4 matmul per active expert (bench/moe_quant.py)
        w13_q, w2_q = (Int4CpuStack.pack(*p, group_size) for p in parts)
        return QuantizedExperts(w13_q, w2_q, "int4", "int4-cpu")
    w13_q, w2_q = (Int4Stack.pack(*p, group_size) for p in parts)
    return QuantizedExperts(w13_q, w2_q, "int4", "dequantize")


def _int4(weight: torch.Tensor, num_held: int, group_size: int):
    """(q uint8 [E, N, K], scales [E, N, G], zeros [E, N, G]) of the rows held; the spare
    rows past them quantized as zero weights (q 0, zero point 0, scale 0: they read 0)."""
    rows, n, k = weight.shape
    groups = int4.num_groups(k, group_size)
    q = torch.zeros(rows, n, k, dtype=torch.uint8)
    scales = torch.zeros(rows, n, groups)
    zeros = torch.zeros(rows, n, groups)
    for e in range(num_held):
        w = int4.quantize(weight[e].float().cpu(), group_size, symmetric=False)
        q[e], scales[e], zeros[e] = w.q, w.scales, w.zeros
    device = weight.device
    return q.to(device), scales.to(device), zeros.to(device)


def _fp8(weight: torch.Tensor, num_held: int) -> Fp8Stack:
    rows, n, k = weight.shape
    q = torch.zeros(rows, n, k, dtype=fp8.FP8, device=weight.device)
    scales = torch.zeros(rows, n, device=weight.device)
    for e in range(num_held):
        q[e], scale = fp8.quantize_channel(weight[e].float())
        scales[e] = scale[:, 0]
    return Fp8Stack(q, scales)
