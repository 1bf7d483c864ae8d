"""GGUF checkpoints against transformers' own GGUF loading of the same file: greedy tokens
equal for each block type we read (float, 8-bit, 4-bit legacy and K-quants), for Llama (its
permuted Q/K rows), Qwen2 (q/k/v bias) and Qwen3 (per-head norms), tied and untied heads;
the derived directory (config, tokenizer, chat template) and what is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from tests.workers.gguf.files import write_gguf
from workers import LLM, SamplingParams
from workers.models.gguf import derive_model_dir

PROMPTS = [[5, 17, 99, 230, 41], [300, 2, 7], list(range(60, 100))]


def tiny_hf_model(arch: str, tie: bool) -> torch.nn.Module:
    """A random transformers model whose every matrix row is a whole number of 256-value
    blocks (the K-quants' block size)."""
    kwargs = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=tie,
    )  # fmt: skip
    if arch == "qwen3":
        # transformers 5.24's GGUF loading of qwen3 ignores qwen3.attention.key_length
        # (it keeps Qwen3Config's default head_dim, 128): use that, so the oracle loads it.
        kwargs["head_dim"] = 128
    config = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch](**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    return model


def greedy_transformers(path, prompts, max_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                min_new_tokens=max_tokens, pad_token_id=0,
            )  # fmt: skip
            out.append(gen[0, len(ids) :].tolist())
    return out


def greedy_baton(path, prompts, max_tokens, cache_dir, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(cache_dir))
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(r.token_ids) for r in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "arch,qtype,tie",
    [
        ("llama", Q.F32, True),
        ("llama", Q.F16, False),
        ("llama", Q.BF16, True),
        ("llama", Q.Q8_0, True),
        ("llama", Q.Q4_0, False),
        ("llama", Q.Q4_1, True),
        ("llama", Q.Q4_K, True),
        ("llama", Q.Q5_K, False),
        ("llama", Q.Q6_K, True),
        ("qwen2", Q.Q4_1, False),
        ("qwen3", Q.Q8_0, True),
    ],
    ids=lambda v: v.name if isinstance(v, Q) else str(v),
)
def test_greedy_tokens_equal_transformers_gguf_loading(arch, qtype, tie, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", tiny_hf_model(arch, tie), arch, qtype)
    want = greedy_transformers(path, PROMPTS, 8)
    served = path
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        # Served as stored, on the int4 kernel (bfloat16 arithmetic: the next test);
        # what transformers computes is the file's dequantized tensors, as Baton reads them.
        served = _as_plain(derive_model_dir(path, tmp_path / "cache"), tmp_path)
    got = greedy_baton(served, PROMPTS, 8, tmp_path / "cache", monkeypatch)
    assert got == want


def test_the_derived_directory_describes_the_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf_model("qwen2", False), "qwen2", Q.Q8_0)
    view = derive_model_dir(path, tmp_path / "cache")
    assert view.name == "m" and (view / "model.gguf").resolve() == path.resolve()
    config = json.loads((view / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 512
    tok_config = json.loads((view / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for m in messages %}")
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["add_bos_token"] is False
    # Derived once: a second call finds it; a changed file is derived again.
    assert derive_model_dir(path, tmp_path / "cache") == view
    write_gguf(path, tiny_hf_model("llama", True), "llama", Q.Q8_0)
    again = derive_model_dir(path, tmp_path / "cache")
    assert again != view
    assert json.loads((again / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_what_it_cannot_serve_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        derive_model_dir(path, tmp_path / "cache")
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        derive_model_dir(not_gguf, tmp_path / "cache")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_q4_blocks_are_served_as_int4_as_stored(qtype, tmp_path, monkeypatch):
    """A Q4_0 / Q4_1 / Q4_K file's matrices load as the int4 kernel's weight as they are stored
    (its 4-bit values and per-32 scales, never rounded a second time), by default; the
    model computes what the dequantized file computes, to the int4 kernel's bfloat16
    arithmetic, far closer than quantizing the dequantized weights again."""
    import gguf

    from workers.models import load_model
    from workers.models.gguf.tensors import iter_tensors
    from workers.models.quant import int4

    path = write_gguf(tmp_path / "q4.gguf", tiny_hf_model("llama", True), "llama", qtype)
    view = derive_model_dir(path, tmp_path / "cache")
    config = json.loads((view / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gguf"
    reader = gguf.GGUFReader(str(path))
    # 7 linears x 2 layers, and the embedding (dequantized: not a linear layer)
    assert sum(t.tensor_type == qtype for t in reader.tensors) == 15
    for _, tensor in iter_tensors(view / "model.gguf", config):
        if tensor.is_q4:
            w = tensor.int4_weight()
            assert w.group_size == 32 and w.q.dtype == torch.uint8 and int(w.q.max()) <= 15
            groups = w.q.view(w.q.shape[0], -1, 32).float()
            dequantized = ((groups - w.zeros[..., None]) * w.scales[..., None]).view(w.q.shape)
            torch.testing.assert_close(dequantized, tensor[...], rtol=1e-6, atol=1e-7)

    def no_requantizing(*args, **kwargs):
        raise AssertionError("a Q4 weight was quantized again")

    monkeypatch.setattr(int4, "quantize", no_requantizing)
    cpu = torch.device("cpu")
    model, arch = load_model(view, torch.float32, cpu)  # quantization "none": as stored
    assert load_model(view, torch.float32, cpu, quantization="int4")[0] is not None
    monkeypatch.undo()
    with pytest.raises(ValueError, match="already quantized"):
        load_model(view, torch.float32, cpu, quantization="fp8")
    assert model.model.layers[0].mlp.down_proj.matmul.group_size == 32
    assert model.model.layers[1].self_attn.qkv_proj.matmul.group_size == 32
    plain = _as_plain(view, tmp_path)
    dense, _ = load_model(plain, torch.float32, cpu)
    requantized, _ = load_model(plain, torch.float32, cpu, quantization="int4")
    from tests.workers.test_models import PagedRunner

    ids = torch.tensor(PROMPTS[2])
    logits = []
    for m in (model, dense, requantized):
        runner = PagedRunner(m, arch, [len(ids)])
        logits.append(runner.step([0], [ids], [len(ids)])[0])
    direct, _, again = ((x - logits[1]).norm() / logits[1].norm() for x in logits)
    # The int4 kernel computes in bfloat16 (activations, scales): about 1.7% off the
    # float32 logits here; rounding the dequantized weights to int4 again adds far more.
    assert direct < 0.02, direct
    if qtype != Q.Q4_K:
        # Q4_K's 6-bit sub-scales put this file's random groups on a grid that rounding to
        # nearest finds again; its check is that nothing was quantized (above).
        assert again > 3 * direct, (again, direct)


def _as_plain(view, tmp_path):
    """The GGUF view as a plain safetensors directory of its dequantized weights."""
    import shutil

    from safetensors.torch import save_file

    from workers.models.gguf.tensors import iter_tensors

    plain = tmp_path / "plain"
    if plain.exists():
        return plain
    plain.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(view / name, plain / name)
    config = json.loads((view / "config.json").read_text())
    config.pop("quantization_config", None)  # dense now
    (plain / "config.json").write_text(json.dumps(config))
    tensors = {n: t[...].contiguous() for n, t in iter_tensors(view / "model.gguf", config)}
    save_file(tensors, str(plain / "model.safetensors"))
    return plain
