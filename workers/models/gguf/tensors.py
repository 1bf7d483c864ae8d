"""A GGUF file's tensors under Hugging Face names, dequantized to float32 on first read.

llama.cpp names tensors ``blk.N.attn_q.weight``, ``token_embd.weight``, ...; the table
below maps them onto the Hugging Face names the loader and the models use. Shapes: GGUF
lists dimensions fastest-first (``[in, out]`` for a weight), the reverse of torch's.

Llama files hold Q and K with their rows permuted: llama.cpp's converter reorders each
head's rows from Hugging Face's "halves" RoPE layout to interleaved pairs (its
``LlamaModel.permute``); reading them back undoes that, per head (per KV head for K).
Qwen2/Qwen3 files are converted without it.

Every block type the ``gguf`` package dequantizes is read (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, the K-quants, ...): ``gguf.quants.dequantize`` is llama.cpp's own
reference, in numpy. A tensor is dequantized when the loader first indexes it, so peak
memory is one float32 tensor beside the memory-mapped file.

A Q4_0 or Q4_1 matrix is kept as it is stored, on the INT4 path (the derived config.json
says ``quant_method: gguf``; ``workers/models/quant``), never dequantized and quantized
again (that second rounding would move every weight of a Q4_1 block whose minimum is not
a whole number of steps): ``int4_weight`` reads its 4-bit values and per-32 scales.
A block is 32 weights, ``w = d * q + m`` (Q4_1; Q4_0: ``d * (q - 8)``), ``d`` and ``m``
half precision, then 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31.
Q4_K (the bulk of a Q4_K_M file) maps onto the same path: a super-block of 256 weights is
eight groups of 32, each ``w = d * sc_j * q - dmin * m_j`` with 6-bit ``sc_j`` and ``m_j``
(12 bytes of packed scales after the half-precision ``d`` and ``dmin``), then 128 bytes
where each 32 bytes hold two groups: low nibbles the first, high nibbles the second. Its
per-32 scale ``d * sc_j`` and minimum ``dmin * m_j`` are what ``gguf`` computes, in float32.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K, dequantize

from workers.models.quant.int4 import Int4Weight

Q4_BLOCK = 32  # weights per Q4_0 / Q4_1 block, per Q4_K group
# Bytes per block (Q4_0 / Q4_1: 32 weights; Q4_K: a super-block of 256).
_Q4_TYPES = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q4_K: 144,
}

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for one we do not know."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _LAYER:
        raise ValueError(f"GGUF tensor {name!r} is not one Baton knows how to load")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER[part]}.{kind}"


class GGUFTensor:
    """One tensor of the file, dequantized when indexed (what the weight loaders use of a
    checkpoint tensor: ``shape``, ``narrow``, indexing). Nothing is kept: a loader holding
    every tensor at once (the quantized path's name -> tensor map) holds the mapping only."""

    def __init__(self, tensor: Any, unpermute_heads: int | None) -> None:
        self._tensor = tensor
        self._unpermute_heads = unpermute_heads
        self.shape = torch.Size(int(d) for d in reversed(tensor.shape.tolist()))
        self.type_name = tensor.tensor_type.name

    def value(self) -> torch.Tensor:
        """The whole tensor, float32, in Hugging Face's layout (a new tensor each call)."""
        array = np.asarray(dequantize(self._tensor.data, self._tensor.tensor_type))
        array = array.astype(np.float32, copy=False)
        if not array.flags.writeable:  # F32 data is a view of the read-only mapping
            array = array.copy()
        value = torch.from_numpy(array.reshape(self.shape))
        if self._unpermute_heads is not None:
            value = _unpermute(value, self._unpermute_heads)
        return value.contiguous()

    @property
    def is_q4(self) -> bool:
        """A Q4_0, Q4_1 or Q4_K tensor: ``int4_weight`` reads it as it is."""
        return self._tensor.tensor_type in _Q4_TYPES

    def int4_weight(self) -> Int4Weight:
        """The Q4_0 / Q4_1 / Q4_K weight [out, in] as 4-bit values and per-32 (scale, zero
        point): ``(q - zeros) * scales`` is ``gguf``'s dequantized value to float32 rounding."""
        kind = self._tensor.tensor_type
        out_features, in_features = self.shape
        blocks = np.asarray(self._tensor.data).reshape(out_features, -1, _Q4_TYPES[kind])
        if kind == GGMLQuantizationType.Q4_K:
            q, d, m = _q4_k_groups(blocks)
            q = q.reshape(out_features, in_features)
        else:
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            packed = blocks[..., -16:]
            q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
            q = q.reshape(out_features, in_features)
            m = None
            if kind == GGMLQuantizationType.Q4_1:
                m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        if m is not None:
            # w = d q + m = (q - zero) d with zero = -m / d; a block with d = 0 is all m:
            # a tiny step keeps it so (its zero point then carries m).
            d = np.where(d == 0, np.float32(1e-30), d)
            zeros = -m / d
        else:
            zeros = np.full_like(d, 8.0)
        weight = Int4Weight(
            torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)),
            torch.from_numpy(np.ascontiguousarray(d)),
            torch.from_numpy(np.ascontiguousarray(zeros, dtype=np.float32)),
            Q4_BLOCK,
        )
        if self._unpermute_heads is None:
            return weight
        return Int4Weight(
            *(
                _unpermute(t, self._unpermute_heads).contiguous()
                for t in (weight.q, weight.scales, weight.zeros)
            ),
            Q4_BLOCK,
        )

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.value().narrow(dim, start, length)

    def __getitem__(self, key) -> torch.Tensor:
        return self.value()[key]


def _q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [out, n, 144] as (4-bit values [out, n * 256], per-32 scale
    [out, n * 8], per-32 additive minimum [out, n * 8]: ``w = scale * q + minimum``)."""
    out_features, num_blocks, _ = blocks.shape
    flat = blocks.reshape(-1, 144)
    d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)  # [N, 1]
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(flat[:, 4:16].copy())  # [N, 8] each, 6-bit
    scale = d * sc.astype(np.float32)
    minimum = -(dmin * mins.astype(np.float32))
    qs = flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(-1, 256)  # groups in order: low nibbles, then high
    return (
        q.reshape(out_features, num_blocks * 256),
        scale.reshape(out_features, num_blocks * 8),
        minimum.reshape(out_features, num_blocks * 8),
    )


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order (pairs -> halves) on the first dimension."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def iter_tensors(path: str | Path, config: dict[str, Any]) -> Iterator[tuple[str, GGUFTensor]]:
    """(Hugging Face name, tensor) for every tensor of the GGUF file at ``path``;
    ``config`` is its derived ``config.json`` (heads, to undo Llama's Q/K order)."""
    reader = GGUFReader(str(path))
    is_llama = config.get("model_type") == "llama"
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        heads = None
        if is_llama and ".q_proj." in name:
            heads = config["num_attention_heads"]
        elif is_llama and ".k_proj." in name:
            heads = config["num_key_value_heads"]
        yield name, GGUFTensor(tensor, heads)


def tensor_names(path: str | Path) -> set[str]:
    """The file's tensor names, as llama.cpp spells them."""
    return {tensor.name for tensor in GGUFReader(str(path)).tensors}
