"""Our models against Hugging Face transformers on tiny random checkpoints (float32).

Each model is built and saved by transformers itself, loaded with ``load_model``, and run
over a paged KV cache through three steps: a ragged batch of fresh prompts, a decode step
for every sequence, and a mixed step of decodes plus chunked extends on a cached prefix.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.kernels.paged_batch import build_metadata, positions_for, random_block_tables
from workers.models import SUPPORTED_ARCHITECTURES, ArchConfig, load_model
from workers.models.registry import MODEL_CLASSES

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    attn_implementation="eager",
)

CASES = {
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ),
    "mistral": lambda: MistralForCausalLM(  # GQA ratio 4
        MistralConfig(
            **{**COMMON, "num_hidden_layers": 3}, num_attention_heads=8, num_key_value_heads=2
        )
    ),
    "qwen2": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
        )
    ),
    "qwen3": lambda: Qwen3ForCausalLM(  # head_dim 32 != 64 / 4
        Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    ),
}

BLOCK_SIZE = 8
PROMPT_LENS = [5, 17, 33, 2]  # step 1: fresh prompts, ragged, ending mid-block
CHUNK_LENS = [1, 6, 1, 11]  # step 3: decodes for 0 and 2, cached-prefix chunks for 1 and 3


def make_hf_model(arch: str, tmp_path, **save_kwargs):
    torch.manual_seed(0)
    model = CASES[arch]().eval()
    with torch.no_grad():  # randomize everything, biases and norm weights included
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
    model.save_pretrained(tmp_path, **save_kwargs)
    return model


def hf_logits(model, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(ids[None]).logits[0].float() for ids in token_ids]


class PagedRunner:
    """Drives our model step by step over a poisoned paged cache (huge finite garbage)."""

    def __init__(self, model, config: ArchConfig, total_lens: list[int]):
        self.model = model
        self.device = model.model.norm.weight.device  # CPU here; CUDA for the Triton op set
        gen = torch.Generator().manual_seed(1)
        num_blocks = sum(-(-n // BLOCK_SIZE) for n in total_lens) + 5
        self.block_tables = random_block_tables(total_lens, BLOCK_SIZE, num_blocks, gen)
        self.kv_cache = torch.full(
            (
                num_blocks,
                config.num_hidden_layers,
                2,
                config.num_key_value_heads,
                BLOCK_SIZE,
                config.head_dim,
            ),
            1e6,
            dtype=model.model.norm.weight.dtype,  # the model's dtype (norms are never packed)
            device=self.device,
        )

    def step(self, seqs: list[int], new_ids: list[torch.Tensor], seq_lens: list[int]):
        """Run sequences ``seqs`` (decodes first) with their new tokens; returns logits per seq."""
        query_lens = [len(ids) for ids in new_ids]
        num_decodes = 0
        while (
            num_decodes < len(seqs) and query_lens[num_decodes] == 1 and seq_lens[num_decodes] > 1
        ):
            num_decodes += 1
        tables = [self.block_tables[s] for s in seqs]
        metadata = build_metadata(
            query_lens, seq_lens, tables, BLOCK_SIZE, num_decodes, device=self.device
        )
        ids = torch.cat(new_ids).to(self.device)
        positions = positions_for(query_lens, seq_lens).to(self.device)
        with torch.inference_mode():
            hidden = self.model(ids, positions, self.kv_cache, metadata)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))


@pytest.mark.parametrize("pack_linear", [True, False], ids=["onednn", "f_linear"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_logits_match_hf_over_three_steps(arch, pack_linear, tmp_path):
    hf_model = make_hf_model(arch, tmp_path)
    model, config = load_model(
        tmp_path, torch.float32, torch.device("cpu"), pack_linear=pack_linear
    )
    assert config.architecture == type(hf_model).__name__
    # The path under test is the one asked for (oneDNN packs float32 on every x86 CPU).
    assert model.model.layers[0].self_attn.qkv_proj.weight.is_mkldnn == pack_linear
    assert model.lm_head.weight.is_mkldnn == pack_linear

    gen = torch.Generator().manual_seed(2)
    total_lens = [p + 1 + c for p, c in zip(PROMPT_LENS, CHUNK_LENS, strict=True)]
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in total_lens]
    expected = hf_logits(hf_model, tokens)
    runner = PagedRunner(model, config, total_lens)
    seqs = list(range(len(tokens)))

    def check(got, starts, ends):
        for s, logits in zip(seqs, got, strict=True):
            torch.testing.assert_close(
                logits,
                expected[s][starts[s] : ends[s]],
                atol=1e-4,
                rtol=1e-4,
                msg=lambda m, s=s: f"{arch} seq {s}: {m}",
            )

    # Step 1: every sequence is a fresh prompt (extend from position 0).
    ends = PROMPT_LENS
    got = runner.step(seqs, [t[:n] for t, n in zip(tokens, ends, strict=True)], ends)
    check(got, [0] * 4, ends)

    # Step 2: one decode per sequence.
    starts, ends = ends, [n + 1 for n in ends]
    got = runner.step(seqs, [t[s:e] for t, s, e in zip(tokens, starts, ends, strict=True)], ends)
    check(got, starts, ends)

    # Step 3: decodes first (0, 2), then chunks on top of a cached prefix (1, 3).
    seqs = [0, 2, 1, 3]
    starts = list(ends)
    ends = [s + c for s, c in zip(starts, CHUNK_LENS, strict=True)]
    got = runner.step(seqs, [tokens[s][starts[s] : ends[s]] for s in seqs], [ends[s] for s in seqs])
    check(got, starts, ends)


def test_sharded_checkpoint_loads_the_same(tmp_path):
    make_hf_model("qwen3", tmp_path / "one")
    hf_model = make_hf_model("qwen3", tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    # Unpacked (pack_linear=False): packed weights cannot be read back to compare.
    one, _ = load_model(tmp_path / "one", torch.float32, torch.device("cpu"), pack_linear=False)
    sharded, _ = load_model(
        tmp_path / "sharded", torch.float32, torch.device("cpu"), pack_linear=False
    )
    for (name, a), (_, b) in zip(one.named_parameters(), sharded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # Fused packing really placed q/k/v and gate/up where HF keeps them.
    attn = sharded.model.layers[1].self_attn
    hf_attn = hf_model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, hf_attn.q_proj.weight) and torch.equal(v, hf_attn.v_proj.weight)
    assert torch.equal(k, hf_attn.k_proj.weight)
    gate, up = sharded.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, hf_model.model.layers[1].mlp.gate_proj.weight)
    assert torch.equal(up, hf_model.model.layers[1].mlp.up_proj.weight)


def test_packing_leaves_the_tied_embedding_plain(tmp_path):
    make_hf_model("qwen2", tmp_path)  # tied embeddings
    model, config = load_model(tmp_path, torch.float32, torch.device("cpu"), pack_linear=True)
    embed, head = model.model.embed_tokens, model.lm_head
    assert config.tie_word_embeddings and head.weight.is_mkldnn and not embed.weight.is_mkldnn
    plain, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), pack_linear=False)
    hidden = torch.randn(3, config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            head.compute_logits(hidden), plain.lm_head.compute_logits(hidden)
        )
        ids = torch.tensor([0, 5, config.vocab_size - 1])
        torch.testing.assert_close(embed(ids), plain.model.embed_tokens(ids), rtol=0, atol=0)


def test_packed_bfloat16_matches_unpacked(tmp_path):
    # bfloat16 packs where the CPU has a oneDNN kernel for it; its logits must not drift
    # from F.linear's. Packing forced: "auto" keeps whichever the start-up timing finds
    # faster, which a loaded machine can decide either way (a CI run once did).
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # torch's check, not our probe's
        pytest.skip("torch: no bfloat16 oneDNN on this CPU")
    make_hf_model("qwen3", tmp_path)
    packed, config = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), pack_linear=True)
    plain, _ = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), pack_linear=False)
    assert packed.lm_head.weight.is_mkldnn and not plain.lm_head.weight.is_mkldnn
    tokens = [torch.arange(1, 12), torch.arange(20, 27)]
    lens = [len(t) for t in tokens]
    got = PagedRunner(packed, config, lens).step([0, 1], tokens, lens)
    want = PagedRunner(plain, config, lens).step([0, 1], tokens, lens)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_bfloat16_load_converts(tmp_path):
    make_hf_model("llama", tmp_path)
    model, config = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    assert config.torch_dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32  # restored


def _rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    make_hf_model("llama", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_weights(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))

    make_hf_model("llama", tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.extra\.weight"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))

    make_hf_model("llama", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_weights(tmp_path, lambda t: t.update({name: torch.ones(95, 64)}))
    with pytest.raises(ValueError, match=rf"{name}.*expected shape \(96, 64\), found \(95, 64\)"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_tied_checkpoint_with_lm_head_present_ignores_it(tmp_path):
    hf_model = make_hf_model("qwen2", tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(101, 64)}))
    model, config = load_model(tmp_path, torch.float32, torch.device("cpu"), pack_linear=False)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, hf_model.model.embed_tokens.weight)


def test_unsupported_architecture_and_no_weights(tmp_path):
    make_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights found"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_registry_covers_supported_architectures():
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
