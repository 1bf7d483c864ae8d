"""Llama 2 / 3 / 3.1 (incl. ``llama3`` RoPE scaling) and Mistral, after Hugging Face's
``modeling_llama.py``, with q/k/v and gate/up fused into tensor-parallel projections.

Qwen2 and Qwen3 reuse these classes with their own attention (see qwen2.py, qwen3.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kernels import KernelOps
from kernels.attention_metadata import AttentionMetadata
from workers.models.arch_config import ArchConfig
from workers.models.attention import Attention
from workers.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from workers.models.parallel import ParallelContext


class LlamaMLP(nn.Module):
    def __init__(self, config: ArchConfig, parallel: ParallelContext, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=config.mlp_bias,
            parallel=parallel,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias, parallel=parallel
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size / tp]
        return self.down_proj(self.ops.silu_and_mul(gate_up))  # [num_tokens, hidden_size]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        layer_idx: int,
        parallel: ParallelContext,
        ops: KernelOps,
        rotary_emb: RotaryEmbedding,
        *,
        qkv_bias: bool | None = None,
        o_proj_bias: bool | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias if qkv_bias is None else qkv_bias,
            parallel=parallel,
        )
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # on this rank
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.attention_bias if o_proj_bias is None else o_proj_bias,
            parallel=parallel,
        )
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            layer_idx=layer_idx,
            ops=ops,
        )

    def split_qkv(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        return q, k, v

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, q_size]
        return self.o_proj(attn_output)  # [num_tokens, hidden_size]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        layer_idx: int,
        parallel: ParallelContext,
        ops: KernelOps,
        attention_cls: type[LlamaAttention],
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, parallel, ops, rotary_emb)
        self.mlp = LlamaMLP(config, parallel, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of each sub-block is fused into the norm that follows it.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        parallel: ParallelContext,
        ops: KernelOps,
        attention_cls: type[LlamaAttention],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        # One cos/sin table for every layer (it can be large: max_position x head_dim).
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            ops,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, parallel, ops, attention_cls, self.rotary_emb)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The ``CausalLM`` the engine runs (see base.py)."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    # (fused parameter, checkpoint name, shard_id): how the loader packs HF tensors.
    packed_modules_mapping: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ArchConfig, parallel: ParallelContext, ops: KernelOps) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, parallel, ops, self.attention_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden_size]; writes this step's K/V into kv_cache."""
        return self.model(input_ids, positions, kv_cache, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32."""
        return self.lm_head.compute_logits(hidden_states)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's architecture under its own name (no biases; sliding window: see
    ``ArchConfig.sliding_window``, not applied by the attention ops)."""
