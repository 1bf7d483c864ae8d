import json
import math
import time

import pytest
import tokenizers
import torch
import transformers
from safetensors import safe_open

from cluster.tools.make_model import ARCHS, make_config, make_model, num_parameters

_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, arch, "tiny") for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_loads_in_transformers(tiny_dirs, arch, tmp_path):
    model_dir = tiny_dirs[arch]
    assert {p.name for p in model_dir.iterdir()} == _FILES
    config = json.loads((model_dir / "config.json").read_text())

    # config.json is what transformers itself writes for this config.
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    hf_config.save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "config.json").read_text())
    resaved.pop("transformers_version")
    assert resaved == config

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    ids = tok.encode("The quick brown fox jumps over the lazy dog").ids
    adds_bos = arch in ("llama", "mistral", "mixtral", "deepseek-v3")
    assert (ids[0] == config["bos_token_id"]) == adds_bos
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert torch.isfinite(logits).all()
    assert 2.0 < logits.std().item() < 8.0  # spread, not flat


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_greedy_generation_varies(tiny_dirs, arch):
    model_dir = tiny_dirs[arch]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for prompt in ("Hello, world!", "Once upon a time"):
        ids = torch.tensor([tok.encode(prompt).ids])
        out = model.generate(
            ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, ids.shape[1] :].tolist()
        assert len(set(out)) >= 8, out
        assert tok.decode(out)  # every id decodes


def test_architecture_flavours(tiny_dirs):
    def tensors(arch):
        with safe_open(str(tiny_dirs[arch] / "model.safetensors"), "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118

    llama = make_config("llama", "tiny")
    assert llama["rope_parameters"]["rope_type"] == "llama3"
    assert "lm_head.weight" in tensors("llama")

    qwen2 = make_config("qwen2", "tiny")
    assert qwen2["tie_word_embeddings"]
    names = tensors("qwen2")
    assert "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.bias" in names

    qwen3 = make_config("qwen3", "tiny")
    assert qwen3["head_dim"] != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    names = tensors("qwen3")
    assert names["model.layers.1.self_attn.k_norm.weight"].shape == (qwen3["head_dim"],)
    norm = names["model.norm.weight"]
    assert norm.min() > 0.5 and norm.max() < 1.5  # near 1

    mistral = make_config("mistral", "tiny")
    assert mistral["sliding_window"] is None
    assert mistral["rope_parameters"]["rope_type"] == "default"


def test_generation_and_tokenizer_config(tiny_dirs):
    gen = json.loads((tiny_dirs["qwen2"] / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": [2, 0]}
    tok_config = json.loads((tiny_dirs["mistral"] / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<s>"
    assert tok_config["eos_token"] == "</s>"


def test_same_seed_same_files(tiny_dirs, tmp_path):
    again = make_model(tmp_path / "again", "qwen3", "tiny", seed=0)
    for name in _FILES:
        assert (again / name).read_bytes() == (tiny_dirs["qwen3"] / name).read_bytes(), name
    other = make_model(tmp_path / "other", "qwen3", "tiny", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_tiny_is_fast(tmp_path):
    start = time.perf_counter()
    make_model(tmp_path / "m", "llama", "tiny")
    assert time.perf_counter() - start < 5.0  # ~0.1 s; generous for loaded CI machines


@pytest.mark.parametrize("arch", ARCHS)
def test_small_parameter_count(arch):
    config = make_config(arch, "small")
    assert 50e6 <= num_parameters(config) <= 100e6
    assert config["vocab_size"] == 8192


@pytest.mark.slow
def test_small_written_and_loadable(tmp_path):
    out = make_model(tmp_path / "small", "qwen2", "small")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert num_params == num_parameters(config)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        make_model(tmp_path / "a", "gpt2", "tiny")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        make_model(tmp_path / "a", "llama", "huge")
    with pytest.raises(ValueError, match="unknown dtype"):
        make_model(tmp_path / "a", "llama", "tiny", dtype="int8")
    assert not (tmp_path / "a").exists()

    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        make_model(full, "llama", "tiny")
    (full / "model-00001-of-00002.safetensors").write_text("stale shard")
    make_model(full, "llama", "tiny", overwrite=True)
    assert {p.name for p in full.iterdir()} == _FILES | {"notes.txt"}

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        make_model(a_file, "llama", "tiny")
