"""Quantized weights: FP8 and INT4 checkpoints in their published layouts, and
quantization on load (``model.quantization: fp8 | int4``). See docs/quantization.md.

The loader (``workers/models/loader.py``) calls ``resolve_spec`` once, then ``prepare``
(turn the chosen linear layers int4, rewrite the checkpoint stream) before loading and
``finalize`` (pack for the device's kernel) after.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from workers.models.quant.checkpoint import TensorSource, transform
from workers.models.quant.formats import QUANTIZATIONS, QuantSpec, resolve
from workers.models.quant.linear import convert_int4_layers, finalize_int4_layers, linear_layers


def resolve_spec(model_dir: str | Path, quantization: str) -> QuantSpec | None:
    """The QuantSpec for ``model_dir``'s config.json and the ``quantization`` setting."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return resolve(config.get("quantization_config"), quantization)


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
