"""What DeepSeek-V2/V3 add to a ``config.json``: multi-head latent attention's dimensions and
the routing of their MoE layers. Read by ``ArchConfig.from_dict`` (no torch here, so the
serving driver can parse a config without it).

Hugging Face keys (transformers 4.x and 5.x spell them alike): ``q_lora_rank`` (None: a
plain ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``, ``rope_interleave`` (V3, default true; V2 always interleaves), and for the
experts ``n_routed_experts``, ``n_shared_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``n_group``, ``topk_group``, ``topk_method``,
``scoring_func``, ``routed_scaling_factor``, ``norm_topk_prob``,
``first_k_dense_replace``, ``moe_layer_freq``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class DeepseekConfig:
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int  # R: the latent c_kv the cache holds per token
    qk_nope_head_dim: int  # each head's key/query part without RoPE (expanded from c_kv)
    qk_rope_head_dim: int  # P: the RoPE part, one key shared by every head
    v_head_dim: int
    rope_interleave: bool  # RoPE on interleaved pairs (x0, x1), (x2, x3), ...
    n_shared_experts: int  # a dense MLP of n_shared * moe_intermediate_size beside the experts
    n_group: int  # experts in this many groups ...
    topk_group: int  # ... of which the best topk_group are eligible
    scoring: str  # "sigmoid" (V3) or "softmax" (V2)
    group_score: str  # a group's score: "top2_sum" (V3) or "max" (V2)
    routed_scaling_factor: float  # multiplies the routed experts' weights
    has_correction_bias: bool  # V3's e_score_correction_bias (choice only, not weights)
    # The softmax scale: qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim)^2.
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_row(self) -> int:
        """Elements each token caches per layer: the latent and the RoPE key (576 in V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def parse_deepseek(
    architecture: str, cfg: dict[str, Any], rope_scaling: dict[str, Any] | None
) -> dict[str, Any]:
    """The ``ArchConfig`` fields of a DeepSeek ``config.json`` (``deepseek`` and the MoE
    fields; ``mlp_only_layers`` from ``first_k_dense_replace`` / ``moe_layer_freq``);
    ValueError naming a key whose value we cannot serve."""
    is_v3 = architecture == "DeepseekV3ForCausalLM"
    num_experts = cfg.get("n_routed_experts") or 0
    num_layers = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace") or 0
    freq = cfg.get("moe_layer_freq", 1) or 1
    if is_v3:
        scoring, group_score = cfg.get("scoring_func", "sigmoid"), "top2_sum"
        topk_method = cfg.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            raise ValueError(f"{architecture}: topk_method {topk_method!r} (want noaux_tc)")
    else:
        scoring, group_score = cfg.get("scoring_func", "softmax"), "max"
        topk_method = cfg.get("topk_method", "greedy")
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"{architecture}: topk_method {topk_method!r} (want greedy or group_limited_greedy)"
            )
    n_group = cfg.get("n_group") or 1
    topk_group = cfg.get("topk_group") or n_group
    if not is_v3 and topk_method == "greedy":
        n_group = topk_group = 1
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"{architecture}: scoring_func {scoring!r} (want sigmoid or softmax)")
    qk_head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    deepseek = DeepseekConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=bool(cfg.get("rope_interleave", True)) if is_v3 else True,
        n_shared_experts=cfg.get("n_shared_experts") or 0,
        n_group=n_group,
        topk_group=topk_group,
        scoring=scoring,
        group_score=group_score,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        has_correction_bias=is_v3,
        softmax_scale=qk_head_dim**-0.5 * _mscale_squared(rope_scaling),
    )
    top_k = cfg.get("num_experts_per_tok") or 0
    if num_experts and not 1 <= top_k <= num_experts // n_group * topk_group:
        raise ValueError(
            f"{architecture}: num_experts_per_tok={top_k} must be in 1.."
            f"{num_experts // n_group * topk_group} (the experts of {topk_group} groups)"
        )
    return {
        "deepseek": deepseek,
        # The RoPE table is qk_rope_head_dim wide (transformers sets head_dim so too).
        "head_dim": cfg["qk_rope_head_dim"],
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": cfg.get("moe_intermediate_size", 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": tuple(
            i for i in range(num_layers) if not (i >= first_dense and i % freq == 0)
        ),
    }


def _mscale_squared(rope_scaling: dict[str, Any] | None) -> float:
    """YaRN's softmax correction of DeepSeek: ``mscale(factor, mscale_all_dim) ** 2`` when
    the config has ``mscale_all_dim``, else 1 (as transformers' ``yarn_apply_mscale``)."""
    if rope_scaling is None or not rope_scaling.get("mscale_all_dim"):
        return 1.0
    factor = rope_scaling["factor"]
    if factor <= 1:
        return 1.0
    mscale = 0.1 * rope_scaling["mscale_all_dim"] * math.log(factor) + 1.0
    return mscale * mscale
