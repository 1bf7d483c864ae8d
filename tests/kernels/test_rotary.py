"""Rotary embedding against Hugging Face's own rope init functions and rotate_half."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.rotary import apply_rotary, compute_cos_sin_cache

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# YaRN as DeepSeek-V3 configures it (the cos/sin factor from mscale / mscale_all_dim), and
# plainly (the factor from `factor` alone: 0.1 ln 4 + 1).
YARN_DEEPSEEK = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
YARN_PLAIN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def hf_config(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> LlamaConfig:
    params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_parameters=params,
    )


def naive_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]: pair feature j with j + D/2 and rotate the pair by angle pos * inv_freq[j]."""
    out = x.clone()
    half = x.shape[-1] // 2
    for t, pos in enumerate(positions.tolist()):
        for j in range(half):
            angle = torch.tensor(pos, dtype=torch.float32) * inv_freq[j]
            c, s = torch.cos(angle), torch.sin(angle)
            a, b = x[t, :, j], x[t, :, j + half]
            out[t, :, j] = a * c - b * s
            out[t, :, j + half] = b * c + a * s
    return out


@pytest.mark.parametrize("rope_type", ["llama3", "linear"])
def test_scaled_cache_matches_hf_rope_init(rope_type):
    scaling = LLAMA3_SCALING if rope_type == "llama3" else {"rope_type": "linear", "factor": 4.0}
    config = hf_config(128, 500000.0, scaling)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    assert attention_factor == 1.0
    cache = compute_cos_sin_cache(128, 300, 500000.0, scaling, torch.float32)
    freqs = torch.arange(300, dtype=torch.float32)[:, None] * inv_freq[None, :]
    assert cache.shape == (300, 128)
    torch.testing.assert_close(cache, torch.cat((freqs.cos(), freqs.sin()), dim=-1))


def test_llama3_actually_changes_frequencies():
    plain = compute_cos_sin_cache(64, 100, 10000.0, None, torch.float32)
    scaled = compute_cos_sin_cache(64, 100, 10000.0, LLAMA3_SCALING, torch.float32)
    assert not torch.allclose(plain, scaled)
    # Old-style key "type" and explicit "default" are understood.
    assert torch.equal(
        plain, compute_cos_sin_cache(64, 100, 10000.0, {"type": "default"}, torch.float32)
    )


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="'longrope'"):
        compute_cos_sin_cache(
            64, 16, 10000.0, {"rope_type": "longrope", "factor": 2.0}, torch.float32
        )


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(
    "rope_scaling",
    [None, LLAMA3_SCALING, YARN_DEEPSEEK, YARN_PLAIN],
    ids=["default", "llama3", "yarn-deepseek", "yarn"],
)
def test_apply_rotary_matches_hf(head_dim, rope_scaling):
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_heads, num_kv_heads = 9, 8, 2
    positions = torch.tensor([0, 1, 2, 17, 63, 64, 65, 300, 511])
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    cache = compute_cos_sin_cache(head_dim, 512, 10000.0, rope_scaling, torch.float32)
    q_out, k_out = apply_rotary(q, k, positions, cache)

    hf_rope = LlamaRotaryEmbedding(hf_config(head_dim, 10000.0, rope_scaling))
    cos, sin = hf_rope(q, positions[None, :])  # [1, T, D]
    # HF layout is [batch, heads, seq, dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, hf_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_apply_rotary_naive_and_partial_rotary_dim():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 3, 16, generator=gen)
    k = torch.randn(5, 1, 16, generator=gen)
    positions = torch.tensor([4, 0, 9, 2, 7])
    rotary_dim = 8  # only the first 8 features rotate; the rest pass through
    cache = compute_cos_sin_cache(rotary_dim, 10, 10000.0, None, torch.float32)
    q_out, k_out = apply_rotary(q, k, positions, cache)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    torch.testing.assert_close(
        q_out[..., :rotary_dim], naive_rotate(q[..., :rotary_dim], positions, inv_freq)
    )
    torch.testing.assert_close(
        k_out[..., :rotary_dim], naive_rotate(k[..., :rotary_dim], positions, inv_freq)
    )
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(k_out[..., rotary_dim:], k[..., rotary_dim:])
