"""Write a quantized checkpoint from a plain one, in a published layout
(``baton make-model --quantize SCHEME``; also used by tests and benchmarks).

Schemes (the linear layers of the decoder layers are quantized; embedding, LM head and
norms stay as they are, as the published checkpoints do):

- ``fp8``: Hugging Face ``quant_method: fp8``, 128x128 blocks with ``weight_scale_inv``;
- ``fp8-channel``: compressed-tensors ``float-quantized``, per-channel ``weight_scale``,
  dynamic per-token activations (``input_activations.dynamic``), ``lm_head`` ignored;
- ``int4-gptq`` / ``int4-gptq-asym``: GPTQ v1 (``checkpoint_format: gptq``), symmetric or
  asymmetric, ``desc_act: false``;
- ``int4-awq``: AWQ GEMM, asymmetric (``zero_point: true``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.models.quant import fp8, int4

SCHEMES = ("fp8", "fp8-channel", "int4-gptq", "int4-gptq-asym", "int4-awq")


def is_quantized_layer_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a decoder layer's projection weight."""
    return ".layers." in name and name.endswith("_proj.weight")


def quantize_checkpoint(model_dir: str | Path, scheme: str, group_size: int = 128) -> None:
    """Rewrite ``model_dir``'s model.safetensors and config.json quantized with ``scheme``
    (see the module docstring). ``group_size``: int4 input columns per scale."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    if "quantization_config" in config:
        raise ValueError(f"{model_dir} is already quantized")
    weights_path = model_dir / "model.safetensors"
    if not weights_path.is_file():
        raise ValueError(f"{model_dir}: quantizing needs a single model.safetensors")
    with safe_open(weights_path, framework="pt", device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not is_quantized_layer_weight(name):
            out[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        out.update({f"{prefix}.{k}": v for k, v in _quantize(tensor, scheme, group_size).items()})
    config["quantization_config"] = quantization_config(scheme, group_size)
    save_file(out, str(weights_path), metadata={"format": "pt"})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _quantize(weight: torch.Tensor, scheme: str, group_size: int) -> dict[str, torch.Tensor]:
    if scheme == "fp8":
        q, scale_inv = fp8.quantize_block(weight, (128, 128))
        return {"weight": q, "weight_scale_inv": scale_inv}
    if scheme == "fp8-channel":
        q, scale = fp8.quantize_channel(weight)
        return {"weight": q, "weight_scale": scale}
    w = int4.quantize(weight, group_size, symmetric=scheme == "int4-gptq")
    return int4.to_awq(w) if scheme == "int4-awq" else int4.to_gptq(w, v1=True)


def quantization_config(scheme: str, group_size: int) -> dict[str, Any]:
    """config.json's ``quantization_config`` for ``scheme``, as the publishing tools write it."""
    if scheme == "fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"],
        }
    if scheme == "fp8-channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                   "dynamic": False}  # fmt: skip
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                       "dynamic": True}  # fmt: skip
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                }
            },
            "ignore": ["lm_head"],
        }
    if scheme == "int4-awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size,
                "zero_point": True, "version": "gemm"}  # fmt: skip
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": scheme == "int4-gptq",
        "checkpoint_format": "gptq",
    }
