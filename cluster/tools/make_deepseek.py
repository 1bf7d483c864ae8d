"""DeepSeek-V3 for ``baton make-model --arch deepseek-v3`` (``cluster/tools/make_model.py``):
its config.json keys, as transformers 5 saves ``DeepseekV3Config``, and its tensors (the
tokenizer family: ``cluster/tools/families.py``).

Small dimensions of the real architecture: multi-head latent attention with a ``q_lora_rank``
(``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``), the first layer dense
(``first_k_dense_replace`` 1), then MoE layers of 8 routed experts in 4 groups of which 2
are eligible, top-2, sigmoid scores with a random ``e_score_correction_bias``, one shared
expert, ``routed_scaling_factor`` 2.5, and YaRN RoPE (factor 4 over a quarter of
``max_position_embeddings``, ``mscale`` = ``mscale_all_dim`` = 1 as in V3: the softmax
scale grows, the cos/sin table does not), interleaved as V3's is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) by hidden size:
# the real model's proportions (1536, 512, 128, 64, 128 at hidden 7168), scaled down.
_MLA_DIMS = {64: (48, 32, 16, 8, 16), 768: (256, 128, 64, 32, 64)}


def deepseek_config(
    hidden_size: int,
    num_attention_heads: int,
    max_position_embeddings: int,
    moe_intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
) -> dict[str, Any]:
    """The DeepSeek-V3 keys that make_model's common config lacks or sets otherwise."""
    q_lora, kv_lora, nope, rope, v_dim = _MLA_DIMS[hidden_size]
    return {
        "attention_bias": False,
        "first_k_dense_replace": 1,
        "head_dim": rope,  # transformers' DeepseekV3Config sets head_dim = qk_rope_head_dim
        "kv_lora_rank": kv_lora,
        "moe_intermediate_size": moe_intermediate_size,
        "n_group": 4,
        "n_routed_experts": num_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": num_experts_per_tok,
        "num_key_value_heads": num_attention_heads,  # as transformers saves it (MLA: unused)
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layer written
        "output_router_logits": False,
        "pretraining_tp": 1,
        "q_lora_rank": q_lora,
        "qk_head_dim": nope + rope,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "rope_interleave": True,
        "rope_parameters": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": max_position_embeddings // 4,
            "rope_theta": 10000.0,
            "rope_type": "yarn",
        },
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 2,
        "v_head_dim": v_dim,
    }


def deepseek_layer_specs(
    config: Mapping[str, Any], layer: int, mlp_names: tuple[str, str, str]
) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init kind) of decoder layer ``layer``'s tensors (make_model's
    ``_param_specs`` kinds; "buffer": initialised as a bias, not counted as a parameter)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    specs = [
        (p + "input_layernorm.weight", (hidden,), "norm"),
        (a + "q_a_proj.weight", (q_lora, hidden), "linear"),
        (a + "q_a_layernorm.weight", (q_lora,), "norm"),
        (a + "q_b_proj.weight", (heads * (nope + rope), q_lora), "linear"),
        (a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), "linear"),
        (a + "kv_a_layernorm.weight", (kv_lora,), "norm"),
        (a + "kv_b_proj.weight", (heads * (nope + v_dim), kv_lora), "linear"),
        (a + "o_proj.weight", (hidden, heads * v_dim), "attn_out"),
        (p + "post_attention_layernorm.weight", (hidden,), "norm"),
    ]
    if layer < config["first_k_dense_replace"]:
        return specs + _mlp(p + "mlp.", mlp_names, config["intermediate_size"], hidden)
    num_experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    specs += [
        (p + "mlp.gate.weight", (num_experts, hidden), "linear"),
        # A buffer in transformers (not a parameter); initialised as a bias.
        (p + "mlp.gate.e_score_correction_bias", (num_experts,), "buffer"),
    ]
    for e in range(num_experts):
        specs += _mlp(f"{p}mlp.experts.{e}.", mlp_names, inter, hidden)
    shared = inter * config["n_shared_experts"]
    return specs + _mlp(p + "mlp.shared_experts.", mlp_names, shared, hidden)


def _mlp(
    prefix: str, names: tuple[str, str, str], inter: int, hidden: int
) -> list[tuple[str, tuple[int, ...], str]]:
    gate, up, down = names
    return [
        (f"{prefix}{gate}.weight", (inter, hidden), "linear"),
        (f"{prefix}{up}.weight", (inter, hidden), "linear"),
        (f"{prefix}{down}.weight", (hidden, inter), "mlp_out"),
    ]
