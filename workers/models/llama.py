"""Llama 2 / 3 / 3.1 (incl. ``llama3`` RoPE scaling) and Mistral, after Hugging Face's
``modeling_llama.py``, with q/k/v and gate/up fused into tensor-parallel projections.

Pipeline parallelism: a stage builds only its layers (the others are parameterless
:class:`PPMissingLayer` placeholders, so parameter names keep the checkpoint's layer
numbers), the embedding on the first stage, the final norm and the LM head on the last.
The hand-off between stages is visible in ``LlamaModel.forward``.

Qwen2 and Qwen3 reuse these classes with their own attention (see qwen2.py, qwen3.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

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

if TYPE_CHECKING:
    from workers.models.fused_decode import FusedDecode


# (config, layer index in the model, parallel, ops) -> that decoder layer's MLP.
MlpFactory = Callable[[ArchConfig, int, ParallelContext, KernelOps], nn.Module]


class PPMissingLayer(nn.Module):
    """A decoder layer that another pipeline stage runs: no parameters, never called."""


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
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, parallel, ops, rotary_emb)
        # Dense unless given (a MoE model's sparse block: LlamaForCausalLM.make_mlp).
        self.mlp = LlamaMLP(config, parallel, ops) if mlp is None else mlp
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
        make_mlp: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.hidden_size = config.hidden_size
        self.start_layer, self.end_layer = parallel.layer_range(config.num_hidden_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
            if parallel.is_first_stage
            else None
        )
        # One cos/sin table for every layer (it can be large: max_position x head_dim).
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            ops,
        )
        # The stage's KV cache holds its layers only: layer i is its cache's layer i - start.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                i - self.start_layer,
                parallel,
                ops,
                attention_cls,
                self.rotary_emb,
                mlp=None if make_mlp is None else make_mlp(config, i, parallel, ops),
            )
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
            if parallel.is_last_stage
            else None
        )
        # Decode steps in one C++ call (CPU; set by workers/models/fused_decode.py).
        self.fused_decode: FusedDecode | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden_size] on the last stage; None on the others,
        which hand (hidden, residual) to the next stage instead."""
        fused = self.fused_decode
        if fused is not None and fused.takes(input_ids.shape[0], kv_cache, attn_metadata):
            assert self.embed_tokens is not None  # attached on a single stage only
            return fused(self.embed_tokens(input_ids), positions, kv_cache, attn_metadata)
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
            residual = None
        else:
            # [2, num_tokens, hidden_size]: the previous stage's (hidden, residual)
            handed = self.parallel.recv_from_prev_stage(
                (2, input_ids.shape[0], self.hidden_size), self.rotary_emb.cos_sin_cache.dtype,
                input_ids.device,
            )  # fmt: skip
            hidden_states, residual = handed[0], handed[1]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        if self.norm is None:
            self.parallel.send_to_next_stage(torch.stack((hidden_states, residual)))
            return None
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The ``CausalLM`` the engine runs (see base.py)."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    # Each decoder layer's MLP; None: the dense LlamaMLP. MoE models set a staticmethod
    # (workers/models/moe.py).
    make_mlp: ClassVar[MlpFactory | None] = None
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
        self.model = LlamaModel(config, parallel, ops, self.attention_cls, self.make_mlp)
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
            if parallel.is_last_stage
            else None
        )
        embed = self.model.embed_tokens
        if config.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """[T] ids and positions -> [T, hidden_size] (None before the last pipeline stage);
        writes this step's K/V of the stage's layers into kv_cache."""
        return self.model(input_ids, positions, kv_cache, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 (the last pipeline stage only)."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        return self.lm_head.compute_logits(hidden_states)

    def is_other_stage_weight(self, name: str) -> bool:
        """A checkpoint tensor (HF name) that another pipeline stage loads, not this one."""
        model = self.model
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return not model.start_layer <= layer < model.end_layer
        if name.startswith("model.embed_tokens."):
            return model.embed_tokens is None
        if name.startswith(("model.norm.", "lm_head.")):
            return self.lm_head is None
        return False


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's architecture under its own name (no biases; sliding window: see
    ``ArchConfig.sliding_window``, not applied by the attention ops)."""
