"""A loaded model made batch-invariant for ``model.deterministic`` (kernels/batch_invariant.py).

``make_batch_invariant(model)`` wraps every linear layer's and the LM head's ``matmul`` in
``RowPadded`` (a lone row is multiplied beside a copy of itself; on CUDA it gives them the
fixed-tile Triton kernels of kernels/triton_batch_invariant.py instead) and then checks, on each
distinct kind of weight of this model, that a row's result is bitwise the same whatever
rows are beside it; where it is not (a BLAS that blocks by the number of rows, say
``F.linear`` in float32 on MKL), it raises, naming the layer: the mode promises bits, so it
refuses to run rather than run without them. The attention, norms and activation come
from ``kernels.deterministic_kernel_ops``, chosen when the model is built.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels.batch_invariant import LinearFn, RowPadded, distinct_linears, invariance_failures
from workers.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

logger = logging.getLogger(__name__)


def _in_features(layer: nn.Module) -> int:
    if isinstance(layer, RowParallelLinear):
        return layer.input_size_per_partition
    if isinstance(layer, ParallelLMHead):
        return layer.embedding_dim
    return layer.input_size


def _triton_matmul(name: str, matmul: LinearFn, weight: torch.Tensor) -> LinearFn:
    """The batch-invariant Triton multiply for a layer that multiplies through ``matmul``."""
    from kernels import triton_batch_invariant
    from kernels.triton_int4_linear import TritonInt4Matmul

    if isinstance(matmul, TritonInt4Matmul):
        return dataclasses.replace(matmul, block_m=triton_batch_invariant.BLOCK_M)
    if matmul is F.linear and weight.is_floating_point():
        return triton_batch_invariant.linear
    raise ValueError(
        f"model.deterministic: layer {name} multiplies through {matmul!r}, which has no "
        "batch-invariant Triton variant"
    )


def make_batch_invariant(model: nn.Module, dtype: torch.dtype, *, use_triton: bool = False) -> int:
    """Give each linear layer of ``model`` (mutated) a batch-invariant ``matmul`` and probe
    each distinct one; returns how many were probed. On CPU the layer's own multiply in
    ``RowPadded``; with the Triton op set (``use_triton``: CUDA) the fixed-tile kernels of
    ``kernels/triton_batch_invariant.py``. ValueError names the first layer whose rows
    depend on their neighbours, with the row counts that showed it, or a multiply with
    no batch-invariant variant. Call after the weights are loaded and packed (the probe
    multiplies the real weights), and before the C++ decode stack is built (it takes the
    matmuls as they are then)."""
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear | ParallelLMHead):
            continue
        if use_triton:
            module.matmul = _triton_matmul(name, module.matmul, module.weight)
        elif not isinstance(module.matmul, RowPadded):
            module.matmul = RowPadded(module.matmul)
        bias = getattr(module, "bias", None)
        layers.append((name, module.matmul, module.weight.detach(), _in_features(module), bias))
    probed = distinct_linears(layers)
    for name, matmul, weight, in_features, bias in probed:
        failures = invariance_failures(
            matmul, weight, in_features, dtype, None if bias is None else bias.detach()
        )
        if failures:
            raise ValueError(
                f"model.deterministic: layer {name} ({matmul!r}, weight "
                f"{tuple(weight.shape)} {weight.dtype}) gives a row different bits depending "
                f"on the rows beside it (row counts, offsets: {failures[:6]}); this "
                "build of torch cannot serve this model batch-invariantly"
            )
    logger.info("deterministic: %d linear layers, %d kinds probed batch-invariant",
                len(layers), len(probed))  # fmt: skip
    return len(probed)
