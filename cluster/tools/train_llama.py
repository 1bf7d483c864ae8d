"""A small trainable Llama whose ``state_dict`` is a Hugging Face ``LlamaForCausalLM`` checkpoint.

``baton train-model`` trains it on CPU; what it saves is read by Baton's loader and by
``transformers`` alike, so its parameter names, RoPE (plain, ``rope_type: default``, the
rotate-half layout), grouped-query attention, SwiGLU MLP and RMSNorm are exactly
``modeling_llama``'s. Only what training needs is here: a full-sequence causal forward, and a plain KV cache for
the greedy generation of on-policy distillation data (``generate_greedy``; tools may not
import the engine's model: tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of one model; ``config.json`` keys of the same names."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


ROPE_THETA = 10_000.0
RMS_NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + RMS_NORM_EPS))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        head_dim = shape.head_dim
        self.num_heads = shape.num_attention_heads
        self.num_kv_heads = shape.num_key_value_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(shape.hidden_size, self.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, self.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, self.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * head_dim, shape.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Output and this layer's (k, v) ``[batch, kv_heads, past + seq_len, head_dim]``;
        ``past``: the cached (k, v) of earlier positions (then ``seq_len`` must be 1)."""
        batch, seq_len, _ = x.shape
        # [batch, heads, seq_len, head_dim]
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            if seq_len != 1:
                raise ValueError("a cached forward takes one new position at a time")
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(  # one new query sees every cached key
            q, k, v, is_causal=past is None, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size)
        self.mlp = MLP(shape)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class _Body(nn.Module):  # HF's ``model.`` prefix
    def __init__(self, shape: LlamaShape, vocab_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size)


class TrainableLlama(nn.Module):
    """``LlamaForCausalLM`` for training: ``forward(input_ids) -> logits``, float32."""

    def __init__(self, shape: LlamaShape, vocab_size: int, seed: int):
        super().__init__()
        self.shape = shape
        self.model = _Body(shape, vocab_size)
        self.lm_head = nn.Linear(shape.hidden_size, vocab_size, bias=False)
        inv_freq = 1.0 / ROPE_THETA ** (
            torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        # GPT-2 style: std 0.02, the residual outputs scaled down by depth so the stream
        # does not grow with the layers. Drawn in a fixed order from a private generator.
        generator = torch.Generator().manual_seed(seed)
        out_std = 0.02 / (2 * self.shape.num_hidden_layers) ** 0.5
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq_len, vocab]`` of ``input_ids`` ``[batch, seq_len]``, causal."""
        return self._forward(input_ids, None)[0]

    def _forward(
        self, input_ids: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        start = 0 if cache is None else cache[0][0].shape[2]
        positions = torch.arange(start, start + input_ids.shape[1], dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [seq_len, head_dim]
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(input_ids)
        new_cache = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, None if cache is None else cache[i])
            new_cache.append(kv)
        return self.lm_head(self.model.norm(x)), new_cache

    @torch.no_grad()
    def generate_greedy(self, prompts: torch.Tensor, num_new: int) -> torch.Tensor:
        """``prompts`` ``[batch, prompt_len]`` followed by ``num_new`` greedy tokens each
        (EOS not special), over a KV cache: ``[batch, prompt_len + num_new]``."""
        was_training = self.training
        self.eval()
        logits, cache = self._forward(prompts, None)
        out = [prompts]
        for step in range(num_new):
            out.append(logits[:, -1].argmax(-1, keepdim=True))
            if step + 1 < num_new:
                logits, cache = self._forward(out[-1], cache)
        self.train(was_training)
        return torch.cat(out, dim=1)
