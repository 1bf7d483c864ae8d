"""``baton make-model``: write a random-weight Hugging Face model directory, offline.

The directory is what ``transformers`` would save for the architecture — config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json —
so both ``AutoModelForCausalLM.from_pretrained`` and Baton's loader read it. Llama and
Qwen get their real chat template (Llama 3's, ChatML) in tokenizer_config.json, with
Llama 3's header tokens, so the OpenAI API's chat route works on them; Mistral gets none. The
tokenizer is a byte-level BPE trained on the spot on ``cluster.tools.corpus`` (deterministic),
and the model's vocab_size is exactly the tokenizer's, so every sampled id decodes.

Weights are random but deterministic from the seed, and scaled (not the 0.02 training
init) so that activations keep unit size through the layers and logits spread over a few
units: greedy generations wander over many tokens instead of repeating one. The tokenizer
files are ``cluster/tools/make_tokenizer.py``'s; DeepSeek's layer shapes
``cluster/tools/make_deepseek.py``'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from cluster.tools.families import FAMILIES
from cluster.tools.make_deepseek import deepseek_config, deepseek_layer_specs
from cluster.tools.make_tokenizer import build_tokenizer, generation_config, tokenizer_config

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3")
SIZES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")

_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class _Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    qwen3_head_dim: int  # qwen3 sets head_dim explicitly, unlike hidden_size / heads
    dtype: str  # default dtype of the written weights
    moe_intermediate_size: int  # each expert's (Mixtral: its intermediate_size)
    num_experts: int = 8  # MoE architectures: 8 experts, top-2
    num_experts_per_tok: int = 2


_SHAPES = {
    "tiny": _Shape(64, 2, 4, 2, 128, 1024, 2048, 32, "float32", moe_intermediate_size=64),
    "small": _Shape(768, 10, 12, 4, 2048, 8192, 4096, 128, "bfloat16", moe_intermediate_size=256),
}


# Init scales (see the module docstring). Input projections: std = 1/sqrt(fan_in), which
# keeps unit-variance activations; norms: 1 + noise, so a loader that skips one is caught.
_EMBED_STD = 1.0
_LOGIT_STD = 4.0  # lm_head std * sqrt(hidden_size): spread of the logits
_NORM_NOISE_STD = 0.1
_BIAS_STD = 0.1  # larger q/k/v biases make every position's value alike: repetitive output
# Tied models: the MLP writes this many times its unit scale into the residual stream so
# that it, not the current token's embedding, dominates what lm_head (= the embedding) sees.
_TIED_MLP_GAIN = 16.0


def make_model(
    out_dir: str | Path,
    arch: str,
    size: str,
    seed: int = 0,
    *,
    overwrite: bool = False,
    dtype: str | None = None,
    progress: bool = False,
) -> Path:
    """Write a random-weight model of ``arch`` (one of ``ARCHS``) and ``size`` ("tiny":
    hidden 64, 2 layers; "small": about 80M parameters; MoE: 8 experts, top-2) to
    ``out_dir``.

    The same arguments always give byte-identical files. ``dtype`` of the weights defaults
    to float32 for tiny and bfloat16 for small. An existing non-empty ``out_dir`` is
    refused unless ``overwrite``, which replaces only the model files in it.
    Returns the directory.
    """
    config = make_config(arch, size, dtype=dtype)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"{out} exists and is not empty (use overwrite to replace the model)")
        for path in [*out.glob("*.safetensors"), *(out / name for name in _MODEL_FILES)]:
            path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    family = FAMILIES[arch]
    tokenizer = build_tokenizer(arch, config["vocab_size"])
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, family, config))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(config, family))
    tensors = _random_weights(config, seed, progress)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_config(arch: str, size: str, dtype: str | None = None) -> dict[str, Any]:
    """config.json of ``arch``/``size``, key for key as transformers 5 saves it.

    RoPE is in ``rope_parameters`` (transformers 5); llama uses the ``llama3`` rope type.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    shape = _SHAPES[size]
    dtype = dtype or shape.dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    family = FAMILIES[arch]
    eos_ids = [family.special_tokens.index(token) for token in family.eos]
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "attention_dropout": 0.0,
        "bos_token_id": family.special_tokens.index(family.bos),
        "dtype": dtype,
        "eos_token_id": eos_ids if arch == "llama" else eos_ids[0],
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "model_type": arch.replace("-", "_"),
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1_000_000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }
    default_head_dim = shape.hidden_size // shape.num_attention_heads
    if arch == "llama":
        original_len = shape.max_position_embeddings // 4
        config |= {
            "attention_bias": False,
            "head_dim": default_head_dim,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "factor": 4.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": original_len,
                "rope_theta": 500_000.0,
                "rope_type": "llama3",
            },
        }
    elif arch in ("qwen2", "qwen3", "qwen2-moe", "qwen3-moe"):
        config |= {
            "layer_types": ["full_attention"] * shape.num_hidden_layers,
            "max_window_layers": shape.num_hidden_layers,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
        }
        if arch in ("qwen3", "qwen3-moe"):
            config |= {"attention_bias": False, "head_dim": shape.qwen3_head_dim}
    elif arch == "deepseek-v3":  # multi-head latent attention, grouped routing, YaRN
        config |= deepseek_config(
            shape.hidden_size, shape.num_attention_heads, shape.max_position_embeddings,
            shape.moe_intermediate_size, shape.num_experts, shape.num_experts_per_tok,
        )  # fmt: skip
    else:  # mistral, mixtral: plain; no sliding window
        config |= {"head_dim": default_head_dim, "rms_norm_eps": 1e-5, "sliding_window": None}
    return dict(sorted((config | _moe_config(arch, shape)).items()))


def _moe_config(arch: str, shape: _Shape) -> dict[str, Any]:
    """The MoE keys, as transformers 5 saves them (Qwen3-MoE's experts: num_local_experts);
    untied, as the real MoE checkpoints are."""
    if arch == "mixtral":
        return {
            "intermediate_size": shape.moe_intermediate_size,
            "num_experts_per_tok": shape.num_experts_per_tok,
            "num_local_experts": shape.num_experts,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0,
        }
    if arch not in ("qwen2-moe", "qwen3-moe"):
        return {}
    config = {
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": shape.moe_intermediate_size,
        "norm_topk_prob": arch == "qwen3-moe",  # as Qwen3-30B-A3B / Qwen1.5-MoE-A2.7B
        "num_experts_per_tok": shape.num_experts_per_tok,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    }
    if arch == "qwen3-moe":
        return config | {"num_local_experts": shape.num_experts}
    return config | {
        "num_experts": shape.num_experts,
        "qkv_bias": True,
        "shared_expert_intermediate_size": 2 * shape.moe_intermediate_size,
        "sliding_window": 0,  # Qwen2MoeConfig's "off" when not use_sliding_window
    }


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2-moe": "Qwen2MoeForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "deepseek-v3": "DeepseekV3ForCausalLM",
}


def num_parameters(config: Mapping[str, Any]) -> int:
    """Parameter count of a config.json of one of ``ARCHS`` (as loaded, tied once; every
    expert counted; buffers, such as DeepSeek's e_score_correction_bias, not)."""
    return sum(math.prod(shape) for _, shape, kind in _param_specs(config) if kind != "buffer")


def _param_specs(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init kind) of every tensor in the checkpoint."""
    hidden = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    arch = config["model_type"]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    mlp = ("gate_proj", "up_proj", "down_proj") if arch != "mixtral" else ("w1", "w3", "w2")

    specs = [("model.embed_tokens.weight", (vocab, hidden), "embed")]
    for i in range(config["num_hidden_layers"]):
        if arch == "deepseek_v3":
            specs += deepseek_layer_specs(config, i, mlp)
            continue
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (hidden,), "norm"),
            (p + "self_attn.q_proj.weight", (q_size, hidden), "linear"),
            (p + "self_attn.k_proj.weight", (kv_size, hidden), "linear"),
            (p + "self_attn.v_proj.weight", (kv_size, hidden), "linear"),
            (p + "self_attn.o_proj.weight", (hidden, q_size), "attn_out"),
            (p + "post_attention_layernorm.weight", (hidden,), "norm"),
        ]
        if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
            specs += _moe_specs(config, p, mlp)
        else:
            specs += _mlp_specs(p + "mlp.", mlp, inter, hidden)
        if arch in ("qwen2", "qwen2_moe"):
            specs += [
                (p + "self_attn.q_proj.bias", (q_size,), "bias"),
                (p + "self_attn.k_proj.bias", (kv_size,), "bias"),
                (p + "self_attn.v_proj.bias", (kv_size,), "bias"),
            ]
        if arch in ("qwen3", "qwen3_moe"):
            specs += [
                (p + "self_attn.q_norm.weight", (head_dim,), "norm"),
                (p + "self_attn.k_norm.weight", (head_dim,), "norm"),
            ]
    specs.append(("model.norm.weight", (hidden,), "norm"))
    if not config["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, hidden), "lm_head"))
    return specs


def _mlp_specs(
    prefix: str, names: tuple[str, str, str], inter: int, hidden: int
) -> list[tuple[str, tuple[int, ...], str]]:
    gate, up, down = names
    return [
        (f"{prefix}{gate}.weight", (inter, hidden), "linear"),
        (f"{prefix}{up}.weight", (inter, hidden), "linear"),
        (f"{prefix}{down}.weight", (hidden, inter), "mlp_out"),
    ]


def _moe_specs(
    config: Mapping[str, Any], p: str, names: tuple[str, str, str]
) -> list[tuple[str, tuple[int, ...], str]]:
    """A sparse MoE block, per expert, as the Hub's checkpoints and save_pretrained name
    it; the router's std 1/sqrt(hidden) spreads its logits over a few units, so tokens
    go to different experts."""
    hidden = config["hidden_size"]
    num_experts = config.get("num_experts") or config["num_local_experts"]
    if config["model_type"] == "mixtral":
        block, inter = p + "block_sparse_moe.", config["intermediate_size"]
    else:
        block, inter = p + "mlp.", config["moe_intermediate_size"]
    specs = [(block + "gate.weight", (num_experts, hidden), "linear")]
    for e in range(num_experts):
        specs += _mlp_specs(f"{block}experts.{e}.", names, inter, hidden)
    shared = config.get("shared_expert_intermediate_size", 0)
    if shared:  # Qwen2-MoE
        specs += _mlp_specs(block + "shared_expert.", names, shared, hidden)
        specs.append((block + "shared_expert_gate.weight", (1, hidden), "linear"))
    return specs


def _random_weights(
    config: Mapping[str, Any], seed: int, progress: bool
) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, config["dtype"])
    hidden = config["hidden_size"]
    # Tied: the embedding doubles as lm_head and so takes lm_head's scale; a token's own
    # logit then gets a boost of |embedding|^2 / rms(residual), which the larger MLP output
    # (_TIED_MLP_GAIN) makes small, else greedy decoding repeats one token.
    is_tied = config["tie_word_embeddings"]
    embed_std = _LOGIT_STD / math.sqrt(hidden) if is_tied else _EMBED_STD
    mlp_gain = _TIED_MLP_GAIN if is_tied else 1.0
    generator = torch.Generator().manual_seed(seed)
    specs = _param_specs(config)
    tensors: dict[str, torch.Tensor] = {}
    with tqdm(
        total=sum(math.prod(shape) for _, shape, _ in specs),
        desc="random weights",
        unit="param",
        unit_scale=True,
        disable=not progress,
    ) as bar:
        for name, shape, kind in specs:
            weight = torch.randn(shape, generator=generator)
            if kind == "embed":
                weight *= embed_std
            elif kind == "linear":
                weight *= 1.0 / math.sqrt(shape[1])
            elif kind == "attn_out":  # attention adds about as much as the embedding
                weight *= embed_std / math.sqrt(shape[1])
            elif kind == "mlp_out":
                weight *= mlp_gain / math.sqrt(shape[1])
            elif kind == "lm_head":
                weight *= _LOGIT_STD / math.sqrt(hidden)
            elif kind == "norm":
                weight = 1.0 + _NORM_NOISE_STD * weight
            else:  # bias
                weight *= _BIAS_STD
            tensors[name] = weight.to(dtype).contiguous()
            bar.update(weight.numel())
    return tensors


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
