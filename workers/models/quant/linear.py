"""INT4 linear layers: the hook that turns the model's parallel linear layers int4.

``convert_int4_layers`` runs after the model is built and before its weights are loaded:
each chosen ``ColumnParallelLinear`` / ``RowParallelLinear`` (and their fused subclasses)
loses its dense ``weight`` and gets three parameters in the unpacked int4 form
(``kernels/int4_linear.py``): ``qweight`` uint8 [out_p, in_p], ``scales`` and ``zeros``
float32 [out_p, num_groups_p]. Their weight loaders are the layer's own (the column layers
shard dim 0 of all three, with the q/k/v and gate/up offsets; the row layer shards
``qweight``'s dim 1), plus a group-aware one for the row layer's scales and zeros, so
tensor parallelism and the fused projections work unchanged. A row-parallel shard must hold
whole groups (ValueError otherwise).

``finalize_int4_layers`` runs after loading: each layer's weight becomes what the device's
fastest kernel reads, and ``layer.matmul`` that kernel, so ``forward`` is untouched:

- with the Triton op set (CUDA): the Triton dequantize-matmul kernel
  (``kernels/triton_int4_linear.py``), any shape;
- CPU: torch's int4-packed matmul (``kernels.int4_linear.pack_cpu``) where it takes the
  shape (``N % 16 == 0``, ``K % group_size == 0``, group 32..256);
- otherwise the dequantized weight in the model dtype with ``F.linear`` (logged): the same
  numbers, without the speed.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels import int4_linear
from workers.models.layers import ColumnParallelLinear, RowParallelLinear
from workers.models.quant.int4 import num_groups

logger = logging.getLogger(__name__)

_PARTS = ("qweight", "scales", "zeros")


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's column/row-parallel linear layers by module name (not the LM head)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    }


def convert_int4_layers(model: nn.Module, names: set[str], group_size: int) -> None:
    """Give the layers ``names`` (module names) int4 parameters; mutates the model."""
    layers = linear_layers(model)
    unknown = names - set(layers)
    if unknown:
        raise ValueError(f"int4 tensors for layers the model does not have: {sorted(unknown)}")
    for name in sorted(names):
        layer = layers[name]
        out_p, in_p = layer.weight.shape
        device = layer.weight.device
        if (
            isinstance(layer, RowParallelLinear)
            and layer.parallel.tp_size > 1
            and in_p % group_size
        ):
            raise ValueError(
                f"{name}: a tensor-parallel shard of {in_p} input columns does not hold whole "
                f"int4 groups of {group_size}; use a smaller tp_size"
            )
        groups = num_groups(in_p, group_size)
        del layer.weight
        group_loader = _row_group_loader(layer) if isinstance(layer, RowParallelLinear) else None
        layer.qweight = _param((out_p, in_p), torch.uint8, device, layer.weight_loader)
        for part in ("scales", "zeros"):
            loader = group_loader or layer.weight_loader
            setattr(layer, part, _param((out_p, groups), torch.float32, device, loader))
        layer.group_size = group_size


def finalize_int4_layers(
    model: nn.Module, dtype: torch.dtype, device: torch.device, use_triton: bool
) -> int:
    """After loading: pack each int4 layer for ``device``'s kernel (see the module
    docstring; ``use_triton``: the model runs the Triton op set, on CUDA or, in tests,
    in Triton's interpreter); mutates the model; returns how many layers got a kernel."""
    num_packed = num_dense = group_size = 0
    for layer in linear_layers(model).values():
        if not hasattr(layer, "qweight"):
            continue
        q, scales, zeros = (getattr(layer, p).data.to(device) for p in _PARTS)
        for part in _PARTS:
            delattr(layer, part)
        out_p, in_p = q.shape
        group_size = layer.group_size
        if use_triton:
            from kernels import triton_int4_linear  # Triton only where it compiles

            packed, layer.matmul = triton_int4_linear.pack(q, scales, zeros, group_size)
            num_packed += 1
        elif device.type == "cpu" and int4_linear.cpu_kernel_supported(out_p, in_p, group_size):
            packed, layer.matmul = int4_linear.pack_cpu(q, scales, zeros, group_size)
            num_packed += 1
        else:
            num_dense += 1
            packed = int4_linear.dequantize(q, scales, zeros, group_size).to(dtype)
            layer.matmul = F.linear
        layer.weight = nn.Parameter(packed, requires_grad=False)
    if num_dense:
        logger.warning(
            "%d int4 layers have no %s kernel for their shape (groups of %d): dequantized "
            "weights used", num_dense, device.type, group_size,
        )  # fmt: skip
    return num_packed


def _param(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, weight_loader):
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


def _row_group_loader(layer: RowParallelLinear):
    """The row-parallel layer's loader for [out, num_groups] tensors: this rank's groups."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        total = num_groups(layer.input_size, layer.group_size)
        if tuple(loaded.shape) != (param.shape[0], total):
            raise ValueError(
                f"expected shape {(param.shape[0], total)}, found {tuple(loaded.shape)}"
            )
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, layer.parallel.tp_rank * size, size))

    return load
