"""The model architecture, read once from a Hugging Face ``config.json``.

Accepts both the transformers 4.x keys found in checkpoints on the Hub (``rope_theta`` +
``rope_scaling``, ``torch_dtype``) and the 5.x keys that ``save_pretrained`` writes now
(``rope_parameters`` holding ``rope_theta`` and the scaling, ``dtype``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.models.deepseek_config import DEEPSEEK_ARCHITECTURES, DeepseekConfig, parse_deepseek

if TYPE_CHECKING:
    import torch

# Kept here rather than read from the registry so that this module imports no model code;
# tests check the two agree.
SUPPORTED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Mixture-of-Experts architectures (workers/models/moe.py): their MoE keys are read.
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# By name: the serving driver reads the architecture (bring-up's layout checks) without
# loading torch; `torch_dtype` turns the name into a dtype for the engine's side.
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (always on for Qwen2)
    mlp_bias: bool  # bias on gate/up/down (Llama's ``mlp_bias``)
    sliding_window: int | None  # None when every layer attends to the full context
    dtype_name: str | None  # the checkpoint's dtype ("bfloat16", ...), if config.json names one
    # Mixture of experts (workers/models/moe.py); num_experts 0: every layer is dense.
    num_experts: int = 0  # routed experts per MoE layer (Mixtral: num_local_experts)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each routed expert's (Mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k weights to 1 (Mixtral: always)
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (dense MLP)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    # DeepSeek-V2/V3: multi-head latent attention and grouped routing (deepseek_config.py).
    deepseek: DeepseekConfig | None = None

    # The KV cache's per-token geometry (workers/engine/kv_cache.py): K and V of each kv
    # head, or MLA's one latent row shared by every head and every TP rank.
    @property
    def kv_cache_entries(self) -> int:
        """Rows per token, kv head and layer: 2 (K and V), 1 for MLA's latent."""
        return 1 if self.deepseek is not None else 2

    @property
    def kv_cache_heads(self) -> int:
        """The cache's kv heads (a TP rank keeps its share): 1 for MLA."""
        return 1 if self.deepseek is not None else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        """Elements of one row: head_dim, or MLA's kv_lora_rank + qk_rope_head_dim."""
        return self.deepseek.cache_row if self.deepseek is not None else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (the model's numbering) has routed experts,
        as Qwen-MoE decides it; every other layer has a dense MLP of intermediate_size."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The checkpoint's dtype as a torch dtype (imports torch), None if unnamed."""
        import torch

        return None if self.dtype_name is None else getattr(torch, self.dtype_name)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ArchConfig:
        """Parse ``path/config.json``; ValueError for an unsupported architecture."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in {path}")
        return cls.from_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        architectures = cfg.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architectures or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(cfg)
        fields = dict(
            architecture=architecture,
            model_type=cfg.get("model_type", ""),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=_parse_attention_bias(architecture, cfg),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=_parse_sliding_window(architecture, cfg),
            dtype_name=_parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype")),
        )
        fields |= _parse_moe(architecture, cfg)
        if architecture in DEEPSEEK_ARCHITECTURES:
            fields |= parse_deepseek(architecture, cfg, rope_scaling)
        return cls(**fields)


def _parse_attention_bias(architecture: str, cfg: dict[str, Any]) -> bool:
    if architecture == "Qwen2ForCausalLM":  # hard-coded; its config has no attention_bias key
        return True
    if architecture == "Qwen2MoeForCausalLM":  # transformers 5's qkv_bias, on by default
        return bool(cfg.get("qkv_bias", True))
    return bool(cfg.get("attention_bias", False))


def _parse_moe(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a MoE architecture (none for a dense one); ValueError for a top-k
    the experts cannot give."""
    if architecture not in _MOE_ARCHITECTURES:
        return {}
    if architecture == "MixtralForCausalLM":
        moe = {
            "num_experts": cfg["num_local_experts"],
            "moe_intermediate_size": cfg["intermediate_size"],
            "norm_topk_prob": True,
        }
    else:
        # Hub configs say num_experts; transformers 5 saves Qwen3-MoE's as num_local_experts.
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        moe = {
            "num_experts": num_experts,
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": cfg.get("decoder_sparse_step", 1),
            "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size", 0)
            if architecture == "Qwen2MoeForCausalLM"
            else 0,
        }
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(moe["num_experts"], int) or moe["num_experts"] < 0:
        raise ValueError(f"{architecture}: bad number of experts {moe['num_experts']!r}")
    if moe["num_experts"] and (not isinstance(top_k, int) or not 1 <= top_k <= moe["num_experts"]):
        raise ValueError(
            f"{architecture}: num_experts_per_tok={top_k} must be in 1..{moe['num_experts']} "
            "(the number of experts)"
        )
    if moe.get("decoder_sparse_step", 1) < 1:
        raise ValueError(f"{architecture}: decoder_sparse_step must be >= 1")
    return moe | {"num_experts_per_tok": top_k or 0}


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if params is not None:  # transformers 5.x: one dict with theta and scaling
        params = dict(params)
        rope_theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:  # transformers 4.x
        rope_theta = cfg.get("rope_theta", 10000.0)
        params = dict(cfg.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return float(rope_theta), None
    return float(rope_theta), params


def _parse_sliding_window(architecture: str, cfg: dict[str, Any]) -> int | None:
    # Qwen configs carry a sliding_window value that is off unless use_sliding_window.
    if architecture.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        return None
    if architecture == "LlamaForCausalLM":
        return None
    return cfg.get("sliding_window")


def _parse_dtype(name: str | None) -> str | None:
    if name is None:
        return None
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} in config.json; supported: {list(_DTYPES)}")
    return name
