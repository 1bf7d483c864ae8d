"""A checkpoint's static FP8 KV-cache scales, for ``kv_cache_dtype: fp8_e4m3``.

FP8 checkpoints made by llm-compressor / compressed-tensors carry, per attention layer, the
scales their calibration chose for the KV cache: ``model.layers.N.self_attn.k_scale`` and
``...v_scale`` (older AutoFP8 exports: ``...self_attn.k_proj.output_scale`` and
``...v_proj.output_scale``). As in vLLM, ``fp8 = k / k_scale``. Where a layer has them, its
FP8 rows are stored with that scale instead of their own ``amax / 448``
(``kernels/fp8_kv.py``); the cache format is the same, so the rest of the engine, the
hand-off and the peers' fingerprints do not change. With ``kv_cache_dtype: auto`` they are
read and unused.
"""

from __future__ import annotations

import torch
from torch import nn

# checkpoint name suffix -> the Attention module's attribute it sets
_SCALE_OF_SUFFIX = {
    "self_attn.k_scale": "k_scale",
    "self_attn.v_scale": "v_scale",
    "self_attn.k_proj.output_scale": "k_scale",
    "self_attn.v_proj.output_scale": "v_scale",
}
KV_SCALE_SUFFIXES = tuple(_SCALE_OF_SUFFIX)


def load_kv_scale(model: nn.Module, name: str, tensor) -> None:
    """Set the static K or V scale named ``name`` on its layer's ``Attention`` module
    (``.attn`` of ``...self_attn``); mutates that module. A layer this rank does not hold
    (another pipeline stage's) is skipped. Raises ValueError for a scale that is not one
    positive number (per-head scales are not supported)."""
    suffix = next(s for s in KV_SCALE_SUFFIXES if name.endswith(s))
    try:
        attn = model.get_submodule(name[: -len(suffix)] + "self_attn.attn")
    except AttributeError:
        return
    value = tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # 0-dim: no [:]
    if value.numel() != 1 or not float(value.reshape(())) > 0:
        raise ValueError(
            f"checkpoint tensor {name!r}: a static KV scale must be one positive number, "
            f"got {tuple(value.shape)} {value.flatten()[:4].tolist()}"
        )
    setattr(attn, _SCALE_OF_SUFFIX[suffix], float(value.reshape(())))
