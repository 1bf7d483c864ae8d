"""Which quantization a model is loaded with: from config.json's ``quantization_config``
and the engine's ``quantization`` setting (``none`` | ``fp8`` | ``int4``), resolved once.

A quantized checkpoint is read in its own layout whatever the setting says, but a setting
that names a different method is refused (converting between them would lose the
checkpoint's precision silently). A GGUF file with Q4_0 / Q4_1 weights is such a checkpoint
(``quant_method: gguf`` in its derived config.json): those weights load as int4, groups of
32, as they are stored. ``fp8`` / ``int4`` on an unquantized checkpoint quantize
it on load: FP8 per 128x128 block, INT4 asymmetric in groups of 128 (round to nearest; 64
or 32 where 128 does not divide a layer's width: ``quant.on_load_group_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATIONS = ("none", "fp8", "int4")
LAYOUTS = ("fp8-block", "fp8", "compressed-tensors", "gptq", "awq", "gguf", "on-load")
GGUF_Q4_GROUP_SIZE = 32  # weights per GGUF Q4_0 / Q4_1 block
ON_LOAD_GROUP_SIZE = 128
ON_LOAD_FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "fp8" | "int4"
    layout: str  # one of LAYOUTS: how the checkpoint stores it ("on-load": dense, we quantize)
    group_size: int = ON_LOAD_GROUP_SIZE  # int4: input columns per scale
    symmetric: bool = False  # int4 on load: zero point 8
    gptq_v1: bool = True  # GPTQ zero points stored minus one (checkpoint_format "gptq")
    block: tuple[int, int] | None = None  # fp8: the per-block scale's block shape

    @property
    def is_on_load(self) -> bool:
        return self.layout == "on-load"


def resolve(quantization_config: dict[str, Any] | None, requested: str) -> QuantSpec | None:
    """The spec to load with, or None for plain weights; ValueError naming what is wrong
    (an unknown setting, an unsupported layout, or a setting that contradicts the checkpoint)."""
    if requested not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {requested!r}"
        )
    if quantization_config is None:
        if requested == "fp8":
            return QuantSpec("fp8", "on-load", block=ON_LOAD_FP8_BLOCK)
        if requested == "int4":
            return QuantSpec("int4", "on-load")
        return None
    spec = from_checkpoint(quantization_config)
    if requested not in ("none", spec.method):
        raise ValueError(
            f"quantization: {requested} was asked for, but the checkpoint is already quantized "
            f"({spec.method}, {spec.layout}); use none or {spec.method}"
        )
    return spec


def from_checkpoint(qc: dict[str, Any]) -> QuantSpec:
    """config.json's ``quantization_config`` -> QuantSpec; ValueError if not supported."""
    method = qc.get("quant_method")
    if method == "gguf":  # workers/models/gguf/metadata.py writes it for Q4_0 / Q4_1 files
        return QuantSpec("int4", "gguf", group_size=GGUF_Q4_GROUP_SIZE)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            return QuantSpec("fp8", "fp8")
        if len(block) != 2:
            raise ValueError(f"fp8 weight_block_size must be [rows, cols], got {block}")
        return QuantSpec("fp8", "fp8-block", block=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        group_size = qc.get("group_size", qc.get("q_group_size"))
        if bits != 4:
            raise ValueError(f"{method}: only 4-bit weights are supported, got bits={bits}")
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(
                f"{method}: group_size must be a positive int, got {group_size} "
                "(per-channel -1 is not supported)"
            )
        if method == "gptq":
            if qc.get("desc_act"):
                raise ValueError("gptq: desc_act (act-order) checkpoints are not supported")
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported")
            return QuantSpec("int4", "gptq", group_size, bool(qc.get("sym", True)),
                             gptq_v1=fmt == "gptq")  # fmt: skip
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported (only gemm)")
        if not qc.get("zero_point", True):
            raise ValueError("awq: zero_point false is not supported")
        return QuantSpec("int4", "awq", group_size)
    raise ValueError(
        f"quantization_config: quant_method {method!r} is not supported "
        "(fp8, compressed-tensors float-quantized, gptq, awq)"
    )


def _compressed_tensors(qc: dict[str, Any]) -> QuantSpec:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(
            f"compressed-tensors: format {fmt!r} is not supported (only float-quantized)"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors group {name}: only 8-bit float weights")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors group {name}: weight strategy {weights.get('strategy')!r} "
                "is not supported (tensor, channel)"
            )
    return QuantSpec("fp8", "compressed-tensors")
