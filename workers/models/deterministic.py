"""A loaded model made batch-invariant for ``model.deterministic`` (kernels/batch_invariant.py).

``make_batch_invariant(model)`` wraps every linear layer's and the LM head's ``matmul`` in
``RowPadded`` (a lone row is multiplied beside a copy of itself) and then checks, on each
distinct kind of weight of this model, that a row's result is bitwise the same whatever
rows are beside it; where it is not (a BLAS that blocks by the number of rows, say
``F.linear`` in float32 on MKL), it raises, naming the layer: the mode promises bits, so it
refuses to run rather than run without them. The attention, norms and activation come
from ``kernels.deterministic_kernel_ops``, chosen when the model is built.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels.batch_invariant import RowPadded, distinct_linears, invariance_failures
from workers.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

logger = logging.getLogger(__name__)


def _in_features(layer: nn.Module) -> int:
    if isinstance(layer, RowParallelLinear):
        return layer.input_size_per_partition
    if isinstance(layer, ParallelLMHead):
        return layer.embedding_dim
    return layer.input_size


def make_batch_invariant(model: nn.Module, dtype: torch.dtype) -> int:
    """Wrap each linear layer's ``matmul`` of ``model`` (mutated) in ``RowPadded`` and
    probe each distinct one; returns how many were probed. ValueError names the first
    layer whose rows depend on their neighbours, with the row counts that showed it.
    Call after the weights are loaded and packed (the probe multiplies the real weights),
    and before the C++ decode stack is built (it takes the matmuls as they are then)."""
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear | ParallelLMHead):
            continue
        if not isinstance(module.matmul, RowPadded):
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
                f"model.deterministic: layer {name} ({matmul.inner!r}, weight "
                f"{tuple(weight.shape)} {weight.dtype}) gives a row different bits depending "
                f"on the rows beside it (row counts, offsets: {failures[:6]}); this "
                "build of torch cannot serve this model batch-invariantly"
            )
    logger.info("deterministic: %d linear layers, %d kinds probed batch-invariant",
                len(layers), len(probed))  # fmt: skip
    return len(probed)
