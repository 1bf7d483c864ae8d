"""Qwen2, after Hugging Face's ``modeling_qwen2.py``: Llama with a bias on q/k/v (none on
o_proj), often with tied input/output embeddings (handled by ``LlamaForCausalLM``)."""

from __future__ import annotations

from kernels import KernelOps
from workers.models.arch_config import ArchConfig
from workers.models.layers import RotaryEmbedding
from workers.models.llama import LlamaAttention, LlamaForCausalLM
from workers.models.parallel import ParallelContext


class Qwen2Attention(LlamaAttention):
    def __init__(
        self,
        config: ArchConfig,
        layer_idx: int,
        parallel: ParallelContext,
        ops: KernelOps,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__(
            config, layer_idx, parallel, ops, rotary_emb, qkv_bias=True, o_proj_bias=False
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
