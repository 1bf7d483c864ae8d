"""Qwen3-MoE, after Hugging Face's ``modeling_qwen3_moe.py``: Qwen3's attention (per-head
q/k norms, explicit ``head_dim``) with a sparse MoE block (``workers/models/moe.py``) of
``num_experts`` experts of ``moe_intermediate_size``, top-``num_experts_per_tok``,
renormalised when ``norm_topk_prob``; layers listed in ``mlp_only_layers`` or off the
``decoder_sparse_step`` have a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from workers.models.moe import MoeForCausalLM
from workers.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen3Attention
