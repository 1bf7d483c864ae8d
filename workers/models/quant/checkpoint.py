"""Checkpoint tensors -> the tensors the model's parameters take, for each layout.

The loader iterates ``(name, tensor)`` pairs in Hugging Face names and hands each to its
parameter's ``weight_loader``. ``transform`` rewrites the stream of a quantized (or
to-be-quantized) checkpoint so that each linear layer's group of tensors becomes:

- FP8 (any layout, or on load): one dense ``X.weight``, the dequantized float32 weight
  (the loader's ``weight_loader`` converts it to the model dtype); scales are consumed.
- INT4 (GPTQ, AWQ, or on load): ``X.qweight`` uint8 [out, in], ``X.scales`` and ``X.zeros``
  float32 [out, num_groups], the unpacked form of ``int4.Int4Weight``, which the int4
  linear layers' parameters take (``quant/linear.py``) and shard like a dense weight.

A group is read whole on every tensor-parallel rank (the packed layouts do not slice
cleanly along every dim); quantized checkpoints are small, so this costs little.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch

from workers.models.quant import fp8, int4
from workers.models.quant.formats import QuantSpec

_INT4_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
_FP8_SCALES = (".weight_scale", ".weight_scale_inv", ".input_scale")


class TensorSource(Protocol):
    """A checkpoint tensor, possibly lazy: ``[:]`` reads it whole."""

    shape: torch.Size

    def __getitem__(self, key) -> torch.Tensor: ...


def transform(
    tensors: Mapping[str, TensorSource],
    spec: QuantSpec,
    is_linear_weight: Callable[[str], bool],
) -> Iterator[tuple[str, torch.Tensor | TensorSource]]:
    """Yield ``tensors`` (name -> tensor) rewritten for ``spec`` (see the module docstring).

    ``is_linear_weight(name)``: whether checkpoint tensor ``name`` is the weight of a layer
    that quantization on load applies to. Tensors of other layers pass through untouched.
    ValueError names the layer whose tensors are malformed.
    """
    for name, tensor in tensors.items():
        try:
            if spec.method == "int4":
                yield from _int4(name, tensor, tensors, spec, is_linear_weight)
            else:
                yield from _fp8(name, tensor, tensors, spec, is_linear_weight)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def _int4(name, tensor, tensors, spec, is_linear_weight):
    if spec.layout == "gguf":
        if is_linear_weight(name) and getattr(tensor, "is_q4", False):
            # Already 4-bit in groups of 32 (workers/models/gguf/tensors.py): as it is.
            yield from _unpacked(name.removesuffix(".weight"), tensor.int4_weight())
        else:
            yield name, tensor  # other types: dequantized, the layer stays dense
        return
    if spec.is_on_load:
        if name.endswith(".weight") and is_linear_weight(name):
            prefix = name.removesuffix(".weight")
            yield from _unpacked(
                prefix, int4.quantize(tensor[...], spec.group_size, spec.symmetric)
            )
        else:
            yield name, tensor
        return
    if not name.endswith(_INT4_PARTS):
        yield name, tensor
        return
    if not name.endswith(".qweight"):
        return  # read with its qweight
    prefix = name.removesuffix(".qweight")
    group = {p[1:]: tensors[prefix + p][...] for p in _INT4_PARTS if prefix + p in tensors}
    for part in ("qzeros", "scales"):
        if part not in group:
            raise ValueError(f"{prefix}.{part} is missing")
    if spec.layout == "gptq":
        in_features = group["qweight"].shape[0] * 8
        w = int4.from_gptq(group, spec.group_size, in_features, v1=spec.gptq_v1)
    else:
        w = int4.from_awq(group, spec.group_size)
    yield from _unpacked(prefix, w)


def _unpacked(prefix: str, w: int4.Int4Weight) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{prefix}.qweight", w.q
    yield f"{prefix}.scales", w.scales
    yield f"{prefix}.zeros", w.zeros


def _fp8(name, tensor, tensors, spec, is_linear_weight):
    if name.endswith(_FP8_SCALES):
        return  # consumed with the weight; activation scales unused (weight-only)
    if not name.endswith(".weight"):
        yield name, tensor
        return
    prefix = name.removesuffix(".weight")
    if spec.is_on_load:
        if is_linear_weight(name):
            q, scale = fp8.quantize_block(tensor[...], spec.block or (128, 128))
            yield name, fp8.dequantize(q, scale, spec.block or (128, 128))
        else:
            yield name, tensor
        return
    scale_name = prefix + (".weight_scale_inv" if spec.layout == "fp8-block" else ".weight_scale")
    if scale_name not in tensors:
        yield name, tensor  # a layer kept unquantized (lm_head, modules_to_not_convert)
        return
    weight = tensor[...]
    block = spec.block if spec.layout == "fp8-block" else None
    yield name, fp8.dequantize(weight, tensors[scale_name][...], block)
