"""Qwen3, after Hugging Face's ``modeling_qwen3.py``: Llama with an RMSNorm over each
head's ``head_dim`` features of q and k (``q_norm``/``k_norm``) before RoPE, and an
explicit ``head_dim`` that need not equal hidden_size / num_heads."""

from __future__ import annotations

import torch

from kernels import KernelOps
from kernels.attention_metadata import AttentionMetadata
from workers.models.arch_config import ArchConfig
from workers.models.layers import RMSNorm, RotaryEmbedding
from workers.models.llama import LlamaAttention, LlamaForCausalLM
from workers.models.parallel import ParallelContext


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: ArchConfig,
        layer_idx: int,
        parallel: ParallelContext,
        ops: KernelOps,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__(config, layer_idx, parallel, ops, rotary_emb)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
        q = self.q_norm(q)  # [num_tokens, num_heads, head_dim], normed per head
        k = self.k_norm(k)  # [num_tokens, num_kv_heads, head_dim]
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, q_size]
        return self.o_proj(attn_output)  # [num_tokens, hidden_size]


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
