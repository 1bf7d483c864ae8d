"""Quantized weights: FP8 and INT4 checkpoints in their published layouts, and
quantization on load (``model.quantization: fp8 | int4``). See docs/quantization.md.

The loader (``workers/models/loader.py``) calls ``resolve_spec`` once, then ``prepare``
(turn the chosen linear layers int4, rewrite the checkpoint stream) before loading and
``finalize`` (pack for the device's kernel) after.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from kernels.int4_linear import INT4_CPU_GROUP_SIZES
from workers.models.quant.checkpoint import TensorSource, transform
from workers.models.quant.formats import ON_LOAD_GROUP_SIZE, QUANTIZATIONS, QuantSpec, resolve
from workers.models.quant.linear import convert_int4_layers, finalize_int4_layers, linear_layers


def resolve_spec(model_dir: str | Path, quantization: str) -> QuantSpec | None:
    """The QuantSpec for ``model_dir``'s config.json and the ``quantization`` setting."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return resolve(config.get("quantization_config"), quantization)


def on_load_group_size(layers: Iterable[nn.Module]) -> int:
    """The group size to quantize a plain checkpoint's int4 layers with: the largest the
    CPU kernel takes (128, 64, 32) that divides every layer's input width on this rank.

    Why not always 128: SmolLM2's hidden size is 576, which 128 does not divide, and a
    layer the kernel cannot take keeps a dequantized float weight (no faster than float);
    measured there, groups of 128 left 3 of each decoder layer's 4 linears dense. With
    tensor parallelism a row-parallel layer counts by its shard's width (its groups must
    not straddle ranks), so the group, and with it the rounding, can depend on tp_size.
    """
    widths = [_input_width(m) for m in layers]
    for size in sorted((g for g in INT4_CPU_GROUP_SIZES if g <= ON_LOAD_GROUP_SIZE), reverse=True):
        if all(w % size == 0 for w in widths):
            return size
    return ON_LOAD_GROUP_SIZE


def _input_width(layer: nn.Module) -> int:
    return getattr(layer, "input_size_per_partition", None) or layer.input_size


def prepare(
    model: nn.Module,
    tensors: Mapping[str, TensorSource],
    spec: QuantSpec,
    param_name_of: Callable[[str], str],
) -> Iterator[tuple[str, object]]:
    """Make the model's int4 layers int4 (mutates it) and return the checkpoint stream
    rewritten for ``spec``. ``param_name_of``: checkpoint name -> parameter name (the
    loader's fused-projection mapping)."""
    layers = linear_layers(model)

    def module_of(name: str) -> str:
        return param_name_of(name).rsplit(".", 1)[0]

    def is_linear_weight(name: str) -> bool:
        return name.endswith(".weight") and module_of(name) in layers

    if spec.method == "int4":
        if spec.is_on_load:
            names = set(layers)
            spec = replace(spec, group_size=on_load_group_size(layers.values()))
        elif spec.layout == "gguf":
            # The layers whose every part (q, k and v of qkv_proj) is Q4_0 / Q4_1 in the
            # file; a layer with another type in it loads dense, dequantized.
            kinds: dict[str, list[bool]] = {}
            for n, t in tensors.items():
                if is_linear_weight(n):
                    kinds.setdefault(module_of(n), []).append(getattr(t, "is_q4", False))
            names = {module for module, q4 in kinds.items() if all(q4)}
            convert_int4_layers(model, names, spec.group_size)
            return transform(
                tensors, spec, lambda n: n.endswith(".weight") and module_of(n) in names
            )
        else:
            prefixes = (n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight"))
            names = {module_of(p + ".weight") for p in prefixes} & set(layers)
        convert_int4_layers(model, names, spec.group_size)
    return transform(tensors, spec, is_linear_weight)


def finalize(model: nn.Module, dtype: torch.dtype, device: torch.device, use_triton: bool) -> int:
    """After loading: pack the int4 layers for ``device`` (Triton's kernel when the model
    runs the Triton op set); returns how many got a kernel."""
    return finalize_int4_layers(model, dtype, device, use_triton)


__all__ = ["QUANTIZATIONS", "QuantSpec", "finalize", "prepare", "resolve_spec"]
