"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B), after Hugging Face's ``modeling_qwen2_moe.py``:
Qwen2's attention (q/k/v bias: ``qkv_bias``, on by default) with Qwen3-MoE's routing and
dense layers, plus a shared expert in every MoE block (a dense MLP of
``shared_expert_intermediate_size``) scaled per token by ``sigmoid(shared_expert_gate(x))``
and added to the routed experts' sum (``workers/models/moe.py``)."""

from __future__ import annotations

from kernels import KernelOps
from workers.models.arch_config import ArchConfig
from workers.models.layers import RotaryEmbedding
from workers.models.llama import LlamaAttention
from workers.models.moe import MoeForCausalLM
from workers.models.parallel import ParallelContext


class Qwen2MoeAttention(LlamaAttention):
    def __init__(
        self,
        config: ArchConfig,
        layer_idx: int,
        parallel: ParallelContext,
        ops: KernelOps,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__(config, layer_idx, parallel, ops, rotary_emb, o_proj_bias=False)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen2MoeAttention
