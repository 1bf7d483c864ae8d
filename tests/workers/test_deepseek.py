"""DeepSeek-V2/V3 (multi-head latent attention, grouped routing, YaRN) against Hugging Face
transformers, float32: logits over a paged latent cache through three ragged steps, the
absorbed decode against the expanded one on the same cache, the engine's greedy tokens on a
`baton make-model` checkpoint (chunked prefill, a prefix-cache hit), and the latent cache's
bytes per token."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from cluster.tools.make_model import make_model
from kernels.mla_attention import mla_prefill_attention
from tests.kernels.paged_batch import build_metadata, positions_for, random_block_tables
from tests.workers.test_engine import hf_greedy
from tests.workers.test_models import hf_logits
from workers import LLM, SamplingParams
from workers.engine.kv_cache import bytes_per_block
from workers.models import ArchConfig, ParallelContext, load_model
from workers.models.deepseek import DeepseekMoE

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,  # transformers' eager attention repeats per kv head; MLA: unused
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,  # != qk_nope_head_dim
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    attn_implementation="eager",
)
CASES = {
    # q through q_a_proj / q_b_proj, YaRN with an mscale (softmax scale and cos/sin),
    # interleaved RoPE, 8 experts in 4 groups of which 2 are eligible, a correction bias.
    "v3": lambda: DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **COMMON,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            q_lora_rank=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.8,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        )
    ),
    # q_proj (no q_lora_rank), softmax scores, group-limited greedy by each group's best.
    "v2": lambda: DeepseekV2ForCausalLM(
        DeepseekV2Config(
            **COMMON,
            num_hidden_layers=2,
            first_k_dense_replace=0,
            q_lora_rank=None,
            n_routed_experts=6,
            n_shared_experts=2,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=3,
            topk_group=2,
            routed_scaling_factor=1.5,
        )
    ),
}
MOE_LAYERS = {"v3": [1, 2], "v2": [0, 1]}

BLOCK_SIZE = 8
PROMPT_LENS = [5, 17, 33, 2]
CHUNK_LENS = [1, 6, 1, 11]
CPU = torch.device("cpu")


def make_hf_model(case: str, path):
    torch.manual_seed(0)
    model = CASES[case]().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.3)  # large enough to change which experts are picked
    model.save_pretrained(path)
    return model


class LatentRunner:
    """Drives our model step by step over a poisoned latent cache (huge finite garbage)."""

    def __init__(self, model, config: ArchConfig, total_lens: list[int]):
        self.model = model
        gen = torch.Generator().manual_seed(1)
        num_blocks = sum(-(-n // BLOCK_SIZE) for n in total_lens) + 5
        self.block_tables = random_block_tables(total_lens, BLOCK_SIZE, num_blocks, gen)
        shape = (num_blocks, config.num_hidden_layers, 1, 1, BLOCK_SIZE, config.kv_cache_head_dim)
        self.kv_cache = torch.full(shape, 1e6)

    def step(self, seqs: list[int], new_ids: list[torch.Tensor], seq_lens: list[int]):
        query_lens = [len(ids) for ids in new_ids]
        num_decodes = 0
        while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
            num_decodes += 1
        tables = [self.block_tables[s] for s in seqs]
        metadata = build_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, num_decodes)
        with torch.inference_mode():
            hidden = self.model(
                torch.cat(new_ids), positions_for(query_lens, seq_lens), self.kv_cache, metadata
            )
            return list(self.model.compute_logits(hidden).split(query_lens))


def _three_steps(runner: LatentRunner, tokens: list[torch.Tensor]):
    """(logits, (starts, ends)) of: fresh prompts; a decode each; decodes then chunks on
    a cached prefix."""
    out = []
    ends = PROMPT_LENS
    out.append(([0, 1, 2, 3], runner.step([0, 1, 2, 3], [t[:n] for t, n in zip(tokens, ends, strict=True)], ends), [0] * 4, ends))  # fmt: skip
    starts, ends = ends, [n + 1 for n in ends]
    new = [t[s:e] for t, s, e in zip(tokens, starts, ends, strict=True)]
    out.append(([0, 1, 2, 3], runner.step([0, 1, 2, 3], new, ends), starts, ends))
    seqs, starts = [0, 2, 1, 3], list(ends)
    ends = [s + c for s, c in zip(starts, CHUNK_LENS, strict=True)]
    new = [tokens[s][starts[s] : ends[s]] for s in seqs]
    out.append((seqs, runner.step(seqs, new, [ends[s] for s in seqs]), starts, ends))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_over_three_steps(case, tmp_path):
    hf_model = make_hf_model(case, tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert config.architecture == type(hf_model).__name__
    moe = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, DeepseekMoE)]
    assert moe == MOE_LAYERS[case]
    gen = torch.Generator().manual_seed(2)
    total_lens = [p + 1 + c for p, c in zip(PROMPT_LENS, CHUNK_LENS, strict=True)]
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in total_lens]
    expected = hf_logits(hf_model, tokens)
    for seqs, got, starts, ends in _three_steps(LatentRunner(model, config, total_lens), tokens):
        for s, logits in zip(seqs, got, strict=True):
            torch.testing.assert_close(
                logits, expected[s][starts[s] : ends[s]], atol=1e-4, rtol=1e-4,
                msg=lambda m, s=s: f"{case} seq {s}: {m}",
            )  # fmt: skip


def test_absorbed_decode_equals_expanded(tmp_path):
    """The decodes through W_UK / W_UV on the latent rows, and expanded to per-head K/V
    like a prefill chunk, on the same cache: the same logits up to rounding."""
    make_hf_model("v3", tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU)
    total_lens = [n + 1 for n in PROMPT_LENS]
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in total_lens]
    runner = LatentRunner(model, config, total_lens)
    runner.step([0, 1, 2, 3], [t[:-1] for t in tokens], PROMPT_LENS)
    decode = ([0, 1, 2, 3], [t[-1:] for t in tokens], total_lens)
    absorbed = torch.cat(runner.step(*decode))
    for layer in model.model.layers:
        layer.self_attn.absorb_decodes = False
    expanded = torch.cat(runner.step(*decode))  # rewrites the same rows, reads them again
    torch.testing.assert_close(absorbed, expanded, atol=2e-5, rtol=1e-5)
    assert not torch.equal(absorbed, expanded)  # two computations, not one path twice


def test_absorbed_prefill_equals_expanded(tmp_path):
    """Prefill chunks on the latent rows in the absorbed form (the op the Triton set brings;
    here its PyTorch reference) and expanded per sequence: the same logits up to rounding,
    for whole prompts and for chunks on a cached prefix."""
    make_hf_model("v3", tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU)
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    halves = [n // 2 for n in PROMPT_LENS]
    seqs = list(range(len(PROMPT_LENS)))
    results = []
    for prefill_op in (mla_prefill_attention, None):
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.ops = dataclasses.replace(attn.ops, mla_prefill_attention=prefill_op)
        runner = LatentRunner(model, config, PROMPT_LENS)
        first = runner.step(seqs, [t[:h] for t, h in zip(tokens, halves, strict=True)], halves)
        rest = runner.step(seqs, [t[h:] for t, h in zip(tokens, halves, strict=True)], PROMPT_LENS)
        results.append(torch.cat([*first, *rest]))
    torch.testing.assert_close(results[0], results[1], atol=2e-5, rtol=1e-5)
    assert not torch.equal(results[0], results[1])  # two computations, not one path twice


def test_tensor_parallel_ranks_split_heads_and_experts(tmp_path, monkeypatch):
    """TP=2 loading (no collectives: each rank's partial sums are compared): the heads and
    each expert's intermediate dimension are split, the latent rows every rank caches are
    the same, and the two ranks' attention (prefill and absorbed decode) and MoE outputs
    add up to the whole layer's."""
    make_hf_model("v3", tmp_path)
    monkeypatch.setattr(ParallelContext, "all_reduce", lambda self, x: x)
    models = [
        load_model(tmp_path, torch.float32, CPU, parallel, pack_linear=False)[0]
        for parallel in (ParallelContext(), ParallelContext(0, 2), ParallelContext(1, 2))
    ]
    config = ArchConfig.from_model_dir(tmp_path)
    attn = [m.model.layers[1].self_attn for m in models]
    assert attn[1].kv_b_proj.weight.shape == (2 * (16 + 12), 32) and attn[1].num_heads == 2
    gen = torch.Generator().manual_seed(4)
    seq_lens, hidden = [5, 9], torch.randn(14, config.hidden_size, generator=gen)
    tables = [[3, 0], [1, 4]]
    shape = (5, config.num_hidden_layers, 1, 1, BLOCK_SIZE, config.kv_cache_head_dim)
    caches = [torch.zeros(shape) for _ in models]
    prefill = build_metadata(seq_lens, seq_lens, tables, BLOCK_SIZE, 0)
    decode = build_metadata([1, 1], [6, 10], tables, BLOCK_SIZE, 2)
    with torch.inference_mode():
        for x, metadata in ((hidden, prefill), (hidden[[4, 13]], decode)):
            positions = positions_for(list(metadata.query_lens_cpu), list(metadata.seq_lens_cpu))
            out = [a(positions, x, c, metadata) for a, c in zip(attn, caches, strict=True)]
            torch.testing.assert_close(out[1] + out[2], out[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(caches[1], caches[0]) and torch.equal(caches[2], caches[0])
        moe = [m.model.layers[1].mlp(hidden) for m in models]
    torch.testing.assert_close(moe[1] + moe[2], moe[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("deepseek-v3"), "deepseek-v3", "tiny")


def test_make_model_writes_what_transformers_loads(deepseek_dir):
    model, info = AutoModelForCausalLM.from_pretrained(
        deepseek_dir, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    config = ArchConfig.from_model_dir(deepseek_dir)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert config.mlp_only_layers == (0,) and config.num_experts == 8
    # V3's mscale_all_dim 1 at factor 4: the softmax scale grows by (0.1 ln 4 + 1)^2.
    ds = config.deepseek
    assert ds.softmax_scale == pytest.approx(ds.qk_head_dim**-0.5 * (0.1 * 1.3862944 + 1) ** 2)


def test_engine_greedy_equals_transformers(deepseek_dir):
    """Ragged prompts prefilled in chunks of a 24-token budget, then two prompts whose
    40-token prefix the first batch left in the prefix cache."""
    hf_model = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    vocab = hf_model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 11, 29, 50)]
    shared = prompts[3][:40]
    again = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (3, 9)]
    expected = [hf_greedy(hf_model, p, 16) for p in prompts + again]
    assert all(len(set(want)) > 4 for want in expected), expected
    llm = LLM(
        str(deepseek_dir), dtype="float32", block_size=8, max_num_batched_tokens=24,
        max_num_seqs=8,
    )  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params)
    second = llm.generate(again, params)
    assert [list(out.token_ids) for out in first + second] == expected
    assert [out.num_cached_tokens for out in second] == [40, 40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_cache_bytes_per_token(deepseek_dir, dtype):
    """One row of kv_lora_rank + qk_rope_head_dim per token and layer: no K/V pair, no
    heads (a dense model of the same attention would cache 2 x 4 heads x 24)."""
    llm = LLM(str(deepseek_dir), dtype=str(dtype).removeprefix("torch."), num_kv_blocks=128)
    arch, cache = llm.engine.arch, llm.engine.kv_cache
    ds = arch.deepseek
    row = ds.kv_lora_rank + ds.qk_rope_head_dim
    per_token = row * cache.element_size() * arch.num_hidden_layers
    assert cache.shape == (128, arch.num_hidden_layers, 1, 1, 16, row)
    assert cache[0].numel() * cache.element_size() == per_token * 16
    assert bytes_per_block(
        arch.num_hidden_layers, arch.kv_cache_heads, 16, arch.kv_cache_head_dim, dtype,
        num_entries=arch.kv_cache_entries,
    ) == per_token * 16  # fmt: skip
    # The cache serves: prefill, then absorbed decodes, in this dtype.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7, 8, 9]], params)[0].token_ids) == 4
    # DeepSeek-V3's own dimensions: 576 elements per token and layer, on every TP rank.
    v3 = ArchConfig.from_dict(
        {
            "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
            "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
            "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
            "n_group": 8, "topk_group": 4, "moe_intermediate_size": 2048,
            "first_k_dense_replace": 3, "n_shared_experts": 1,
        }
    )  # fmt: skip
    assert (v3.kv_cache_entries, v3.kv_cache_heads, v3.kv_cache_head_dim) == (1, 1, 576)
    assert v3.mlp_only_layers == (0, 1, 2)


def test_unsupported_routing_is_named():
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 11, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
        "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match="topk_method 'greedy'"):
        ArchConfig.from_dict(cfg | {"topk_method": "greedy"})
    with pytest.raises(ValueError, match=r"num_experts_per_tok=3 must be in 1\.\.2"):
        ArchConfig.from_dict(cfg | {"num_experts_per_tok": 3})


def test_triton_op_set_gives_the_same_tokens(deepseek_dir, monkeypatch):
    """The Triton set (its interpreter on CPU): RMSNorm, RoPE, the fused MoE kernel and the
    MLA decode and prefill kernels on the latent cache (prompts chunked by 24 tokens, so
    chunks on a cached prefix and batches of decodes and chunks); greedy tokens equal the
    reference set's."""
    pytest.importorskip("triton")
    from kernels import get_kernel_ops
    from tests.kernels.triton_testing import IS_INTERPRETED
    from workers.models import loader

    if not IS_INTERPRETED:
        pytest.skip("Triton on CPU tensors needs the interpreter")
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (4, 21, 37)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for use_triton in (False, True):
        monkeypatch.setattr(
            loader, "get_kernel_ops", lambda dev, t=use_triton: get_kernel_ops(dev, use_triton=t)
        )
        llm = LLM(
            str(deepseek_dir), dtype="float32", block_size=16, max_num_batched_tokens=24,
            max_num_seqs=8, max_model_len=128, num_kv_blocks=32,
        )  # fmt: skip
        assert llm.engine.model.model.layers[1].mlp.ops.is_triton == use_triton
        attn_ops = llm.engine.model.model.layers[1].self_attn.ops
        assert (attn_ops.mla_prefill_attention is not None) == use_triton
        outputs.append([list(out.token_ids) for out in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_latent_blocks_go_through_the_host_tier(deepseek_dir):
    """Latent blocks evicted to the host-memory tier and onboarded again give the tokens
    that computing them gives (the tiers copy blocks as bytes: nothing MLA-specific)."""
    rng = random.Random(5)
    shared = [rng.randrange(1000) for _ in range(29)]
    prompts = [shared + [rng.randrange(1000) for _ in range(n)] for n in (4, 13)]
    args = dict(dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [list(o.token_ids) for o in LLM(str(deepseek_dir), **args).generate(prompts, params)]
    llm = LLM(str(deepseek_dir), kv_host_tier_gib=1 / 1024, **args)
    assert [list(o.token_ids) for o in llm.generate(prompts, params)] == want
    num_cached = llm.engine.block_manager.num_cached_blocks
    assert num_cached > 0 and llm.engine.block_manager.evict() == num_cached
    again = llm.generate(prompts, params)
    assert [list(o.token_ids) for o in again] == want
    assert [o.num_cached_tokens for o in again] == [32, 40]  # whole blocks, from the tier


def test_fp8_latent_cache(deepseek_dir, monkeypatch):
    """``kv_cache_dtype: fp8_e4m3`` on the latent cache: each row's R + P values in FP8 and
    one float32 scale, ``R + P + 4`` bytes per token and layer. What it promises: the
    bytes a prompt leaves in the cache are the prompt's, so a prefix hit (the same rows,
    read back) and the host tier give the tokens computing gives; the Triton set reads the
    rows as the reference does (same tokens)."""
    args = dict(
        dtype="float32", block_size=8, max_num_batched_tokens=24, max_num_seqs=8,
        num_kv_blocks=64, max_model_len=256, kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    rng = random.Random(11)
    shared = [rng.randrange(1000) for _ in range(33)]
    prompts = [shared + [rng.randrange(1000) for _ in range(n)] for n in (3, 14)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(deepseek_dir), **args)
    arch, cache = llm.engine.arch, llm.engine.kv_cache
    row = arch.deepseek.kv_lora_rank + arch.deepseek.qk_rope_head_dim
    assert cache.dtype == torch.uint8 and cache.shape == (
        64,
        arch.num_hidden_layers,
        1,
        1,
        8,
        row + 4,
    )
    assert bytes_per_block(
        arch.num_hidden_layers, 1, 8, row, torch.float32, "fp8_e4m3", num_entries=1
    ) == (row + 4) * arch.num_hidden_layers * 8  # fmt: skip
    want = [list(o.token_ids) for o in llm.generate(prompts, params)]
    again = llm.generate(prompts, params)  # the prompts' rows read back from the cache
    assert [list(o.token_ids) for o in again] == want
    assert [o.num_cached_tokens for o in again] == [32, 40]
    tiered = LLM(str(deepseek_dir), kv_host_tier_gib=1 / 1024, **args)
    assert [list(o.token_ids) for o in tiered.generate(prompts, params)] == want
    assert tiered.engine.block_manager.evict() > 0
    assert [list(o.token_ids) for o in tiered.generate(prompts, params)] == want

    from kernels import get_kernel_ops
    from tests.kernels.triton_testing import IS_INTERPRETED
    from workers.models import loader

    if IS_INTERPRETED:  # the Triton set on CPU tensors: its interpreter (always, in CI)
        monkeypatch.setattr(
            loader, "get_kernel_ops", lambda dev: get_kernel_ops(dev, use_triton=True)
        )
        triton_llm = LLM(str(deepseek_dir), **args)
        assert [list(o.token_ids) for o in triton_llm.generate(prompts, params)] == want
