"""Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against Hugging Face
transformers, float32: logits over a paged cache through three ragged steps, and the
engine's greedy tokens on `baton make-model` checkpoints; both checkpoint layouts of the
experts; routing (renormalised or not, dense layers by decoder_sparse_step and
mlp_only_layers); what is refused."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from cluster.tools.make_model import make_model
from kernels import REFERENCE_OPS
from kernels.moe import select_experts
from tests.workers.test_engine import hf_greedy
from tests.workers.test_models import PagedRunner, hf_logits
from workers import LLM, SamplingParams
from workers.models import ArchConfig, ParallelContext, load_model
from workers.models import loader as loader_module
from workers.models.moe import SparseMoeBlock

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    attn_implementation="eager",
)

CASES = {
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2)
    ),
    # Layer 1 dense (mlp_only_layers), top-3 renormalised, head_dim 32 != 64 / 4.
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **{**COMMON, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    ),
    # Layers 1 and 3 sparse (decoder_sparse_step 2), not renormalised, a shared expert.
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **{**COMMON, "num_hidden_layers": 4},
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        )
    ),
}
SPARSE_LAYERS = {"mixtral": [0, 1], "qwen3_moe": [0, 2], "qwen2_moe": [1, 3]}

PROMPT_LENS = [5, 17, 33, 2]
CHUNK_LENS = [1, 6, 1, 11]
CPU = torch.device("cpu")


def make_hf_model(arch: str, path, **save_kwargs):
    torch.manual_seed(0)
    model = CASES[arch]().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
    model.save_pretrained(path, **save_kwargs)
    return model


@pytest.mark.parametrize("arch", sorted(CASES))
def test_logits_match_hf_over_three_steps(arch, tmp_path):
    hf_model = make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU)
    assert config.architecture == type(hf_model).__name__
    sparse = [
        i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)
    ]
    hf_sparse = [
        i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "experts")
    ]
    assert sparse == hf_sparse == SPARSE_LAYERS[arch]

    gen = torch.Generator().manual_seed(2)
    total_lens = [p + 1 + c for p, c in zip(PROMPT_LENS, CHUNK_LENS, strict=True)]
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in total_lens]
    expected = hf_logits(hf_model, tokens)
    runner = PagedRunner(model, config, total_lens)

    def check(seqs, got, starts, ends):
        for s, logits in zip(seqs, got, strict=True):
            torch.testing.assert_close(
                logits, expected[s][starts[s] : ends[s]], atol=1e-4, rtol=1e-4,
                msg=lambda m, s=s: f"{arch} seq {s}: {m}",
            )  # fmt: skip

    seqs, ends = [0, 1, 2, 3], PROMPT_LENS  # fresh prompts
    new = [t[:n] for t, n in zip(tokens, ends, strict=True)]
    check(seqs, runner.step(seqs, new, ends), [0] * 4, ends)
    starts, ends = ends, [n + 1 for n in ends]  # a decode each
    new = [t[s:e] for t, s, e in zip(tokens, starts, ends, strict=True)]
    check(seqs, runner.step(seqs, new, ends), starts, ends)
    seqs, starts = [0, 2, 1, 3], list(ends)  # decodes, then chunks on a cached prefix
    ends = [s + c for s, c in zip(starts, CHUNK_LENS, strict=True)]
    new = [tokens[s][starts[s] : ends[s]] for s in seqs]
    check(seqs, runner.step(seqs, new, [ends[s] for s in seqs]), starts, ends)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_engine_greedy_equals_transformers_on_make_model_checkpoints(arch, tmp_path):
    """`make-model`'s own checkpoint: transformers and the engine read it, and the engine's
    greedy tokens on a ragged, chunked batch equal transformers' (and are not one token)."""
    path, num_new = tmp_path, 16
    make_model(path, arch, "tiny", overwrite=True)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    vocab = hf_model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 11, 29, 50)]
    expected = [hf_greedy(hf_model, p, num_new) for p in prompts]
    assert all(len(set(want)) > 4 for want in expected), expected
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=24, max_num_seqs=8)
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    assert [list(out.token_ids) for out in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize("arch", sorted(CASES))
def test_stacked_and_per_expert_checkpoints_load_the_same(arch, tmp_path):
    hf_model = make_hf_model(arch, tmp_path / "hub")  # per expert, as save_pretrained writes
    make_hf_model(arch, tmp_path / "stacked", save_original_format=False)
    hub_names = set(load_file(tmp_path / "hub" / "model.safetensors"))
    stacked_names = set(load_file(tmp_path / "stacked" / "model.safetensors"))
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    layer = SPARSE_LAYERS[arch][0]
    assert (
        f"model.layers.{layer}.{block}.experts.3.{'w3' if arch == 'mixtral' else 'up_proj'}.weight"
        in hub_names
    )
    assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in stacked_names
    hub, _ = load_model(tmp_path / "hub", torch.float32, CPU, pack_linear=False)
    stacked, _ = load_model(tmp_path / "stacked", torch.float32, CPU, pack_linear=False)
    for (name, a), (_, b) in zip(hub.named_parameters(), stacked.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    hf_mlp, ours = hf_model.model.layers[layer].mlp, hub.model.layers[layer].mlp
    assert torch.equal(ours.experts.w13, hf_mlp.experts.gate_up_proj)
    assert torch.equal(ours.experts.w2, hf_mlp.experts.down_proj)
    assert torch.equal(ours.gate.weight, hf_mlp.gate.weight)


def test_a_missing_expert_is_named_in_either_layout(tmp_path):
    make_hf_model("mixtral", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        load_model(tmp_path, torch.float32, CPU)
    make_hf_model("qwen3_moe", tmp_path, save_original_format=False)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.layers.2.mlp.experts.down_proj")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.0\.down_proj"
    ):
        load_model(tmp_path, torch.float32, CPU)


def test_tensor_parallel_ranks_hold_slices_of_every_expert(tmp_path, monkeypatch):
    """TP=2 loading (no collectives at load): each rank holds its half of every expert's
    intermediate dimension and reads only that from the file, in either layout; the
    halves' partial sums add up to the whole block's output."""
    make_hf_model("qwen2_moe", tmp_path)
    make_hf_model("qwen2_moe", tmp_path / "stacked", save_original_format=False)
    whole, config = load_model(tmp_path, torch.float32, CPU, pack_linear=False)
    read = []
    iter_tensors = loader_module._iter_tensors

    def recording(files):
        for name, tensor in iter_tensors(files):
            if ".experts." in name:
                read.append(tensor)
            yield name, tensor

    monkeypatch.setattr(loader_module, "_iter_tensors", recording)
    x = torch.randn(7, config.hidden_size)
    ranks = []
    for rank in range(2):
        models = []
        for path in (tmp_path, tmp_path / "stacked"):
            read.clear()
            parallel = ParallelContext(rank, 2)
            model, _ = load_model(path, torch.float32, CPU, parallel, pack_linear=False)
            experts = [getattr(layer.mlp, "experts", None) for layer in model.model.layers]
            experts = [e for e in experts if e is not None]
            held = sum(e.w13.numel() + e.w2.numel() for e in experts)
            assert sum(t.elements_read for t in read) == held  # its slices, nothing more
            models.append(model)
        for (name, a), (_, b) in zip(*(m.named_parameters() for m in models), strict=True):
            assert torch.equal(a, b), name
        ranks.append(models[0].model.layers[1].mlp)
    assert ranks[0].experts.w13.shape == (6, 32, config.hidden_size)  # 2 x 32 / 2
    block = whole.model.layers[1].mlp
    with torch.no_grad():
        routed = [
            m.ops.fused_moe(x, m.experts.w13, m.experts.w2, *select_experts(m.gate(x), 2, renormalize=False))
            for m in [block, *ranks]
        ]  # fmt: skip
    torch.testing.assert_close(routed[1] + routed[2], routed[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_weights_renormalised_or_not(renormalize):
    config = ArchConfig.from_dict(
        {
            "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 11, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "norm_topk_prob": renormalize,
        }
    )  # fmt: skip
    torch.manual_seed(0)
    block = SparseMoeBlock(config, ParallelContext(), REFERENCE_OPS)
    for p in block.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(9, 16)
    with torch.no_grad():
        got = block(x)
        # Per token, per chosen expert: the definition, without grouping.
        probs = torch.softmax(block.gate(x), dim=-1)
        want = torch.zeros_like(x)
        for t in range(9):
            top = probs[t].topk(2)
            weights = top.values / top.values.sum() if renormalize else top.values
            for w, e in zip(weights, top.indices.tolist(), strict=True):
                gate, up = (block.experts.w13[e] @ x[t]).chunk(2)
                want[t] += w * (block.experts.w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights, _ = select_experts(block.gate(x), 2, renormalize=renormalize)
    assert torch.allclose(weights.sum(-1), torch.ones(9)) == renormalize


def test_dense_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    base = {
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 11, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 6, "num_attention_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
    }  # fmt: skip

    def sparse(**keys):
        config = ArchConfig.from_dict(base | keys)
        return [i for i in range(6) if config.is_moe_layer(i)]

    assert sparse() == [0, 1, 2, 3, 4, 5]
    assert sparse(decoder_sparse_step=2) == [1, 3, 5]
    assert sparse(decoder_sparse_step=3, mlp_only_layers=[5]) == [2]
    assert sparse(mlp_only_layers=[0, 4]) == [1, 2, 3, 5]
    assert sparse(num_experts=0, num_experts_per_tok=None) == []


def test_configs_read_both_key_spellings_and_bad_top_k_is_refused(tmp_path):
    base = {
        "vocab_size": 11, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 1, "num_attention_heads": 2, "moe_intermediate_size": 8,
    }  # fmt: skip
    qwen3 = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 2} | base
    # Hub configs say num_experts; transformers 5 saves Qwen3-MoE's as num_local_experts.
    assert ArchConfig.from_dict(qwen3 | {"num_experts": 6}).num_experts == 6
    assert ArchConfig.from_dict(qwen3 | {"num_local_experts": 6}).num_experts == 6
    mixtral = ArchConfig.from_dict(
        base | {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 64}
    )  # fmt: skip
    assert (mixtral.norm_topk_prob, mixtral.moe_intermediate_size, mixtral.sliding_window) == (
        True, 24, 64,
    )  # fmt: skip
    make_model(tmp_path, "mixtral", "tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in 1\.\.8"):
        load_model(tmp_path, torch.float32, CPU)


def test_deterministic_moe_is_refused_by_name(tmp_path):
    # (Quantized MoE checkpoints: tests/workers/test_moe_quant.py.)
    make_model(tmp_path, "qwen3-moe", "tiny")
    config = ArchConfig.from_model_dir(tmp_path)
    ops = dataclasses.replace(REFERENCE_OPS, is_batch_invariant=True)
    with pytest.raises(ValueError, match=r"model\.deterministic: the MoE experts"):
        SparseMoeBlock(config, ParallelContext(), ops)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_parallel_engine_equals_the_single_process_engine(tp, pp, tmp_path):
    """A replica over gloo, as tests/workers/test_{tensor,pipeline}_parallel.py run one:
    rank 0's greedy tokens equal one process's (TP: the experts' partial sums
    all-reduced; PP: each stage loads its layers' experts only)."""
    import torch.multiprocessing as mp

    from tests.workers import test_pipeline_parallel, test_tensor_parallel
    from workers.engine.llm_engine import LLMEngine
    from workers.parallel.replica import free_port

    model_dir = str(make_model(tmp_path / "tiny", "qwen2-moe", "tiny"))
    want = test_tensor_parallel._generate(LLMEngine(test_tensor_parallel._config(model_dir)))
    port, out = free_port("127.0.0.1"), str(tmp_path)
    if pp == 1:
        main, args = test_tensor_parallel._rank_main, (tp, port, model_dir, out)
    else:
        main, args = test_pipeline_parallel._rank_main, (tp * pp, pp, port, model_dir, out)
    mp.start_processes(main, args=args, nprocs=tp * pp, join=True, start_method="spawn")
    assert json.loads((tmp_path / "rank0.json").read_text())["tokens"] == want
