"""ArchConfig parses both config.json generations (transformers 4.x on the Hub, 5.x now)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from workers.models.arch_config import ArchConfig

# As found in Meta-Llama-3.1-8B-Instruct's config.json (transformers 4.x keys), abridged.
LLAMA31_V4 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def test_transformers_4_keys():
    config = ArchConfig.from_dict(LLAMA31_V4)
    assert config.head_dim == 128
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LLAMA31_V4["rope_scaling"]
    assert config.torch_dtype == torch.bfloat16
    assert config.sliding_window is None and not config.attention_bias


def test_old_linear_scaling_key_and_defaults():
    raw = {**LLAMA31_V4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    del raw["num_key_value_heads"], raw["rope_theta"], raw["torch_dtype"]
    config = ArchConfig.from_dict(raw)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.rope_theta == 10000.0
    assert config.num_key_value_heads == 32 and config.torch_dtype is None


def test_transformers_5_save_pretrained(tmp_path):
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1234.0},
        dtype="float16",
        architectures=["LlamaForCausalLM"],
    )
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in raw  # the 5.x shape this test is about
    config = ArchConfig.from_model_dir(tmp_path)
    assert config.rope_theta == 1234.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.head_dim == 32 and config.num_key_value_heads == 2
    assert config.torch_dtype == torch.float16


def test_qwen2_bias_and_sliding_window_off(tmp_path):
    Qwen2Config(
        hidden_size=64, num_attention_heads=4, architectures=["Qwen2ForCausalLM"]
    ).save_pretrained(tmp_path)
    config = ArchConfig.from_model_dir(tmp_path)
    assert config.attention_bias  # Qwen2 always has q/k/v bias
    assert config.rope_scaling is None and config.sliding_window is None


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], [], None])
def test_unsupported_architecture(architectures):
    with pytest.raises(ValueError, match=r"unsupported architecture.*Qwen3ForCausalLM"):
        ArchConfig.from_dict({**LLAMA31_V4, "architectures": architectures})


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        ArchConfig.from_model_dir(tmp_path)
