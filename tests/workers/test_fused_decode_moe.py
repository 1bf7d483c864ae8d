"""The C++ decoder-layer stack on MoE models (kernels/csrc/moe_block.h, built by
workers/models/fused_decode.py) against the eager layers it replaces for decode steps:
Mixtral, Qwen3-MoE (top-3 renormalised, a dense layer among sparse ones, head_dim != H/heads)
and Qwen2-MoE (not renormalised, q/k/v bias, a gated shared expert, dense layers between
sparse ones). Ragged batches over a poisoned paged cache give the same logits, the same
cache and the same expert-load counts, to the bit, float32 and bfloat16, with plain and
oneDNN-packed attention weights; the engine's greedy tokens with the stack equal
transformers' (float32) on make-model checkpoints; where the stack cannot compute a MoE
model exactly (quantized experts) the model stays eager.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.tools.make_model import make_model
from kernels import cpu_extension
from tests.workers.test_engine import hf_greedy
from tests.workers.test_fused_decode import _decode, _fused_against_eager, _prefill
from tests.workers.test_models import PROMPT_LENS
from tests.workers.test_moe_models import SPARSE_LAYERS, make_hf_model
from workers import LLM, SamplingParams
from workers.models import load_model
from workers.models.fused_decode import FusedDecode, _moe_block, attach_fused_decode
from workers.models.moe import SparseMoeBlock

CPU = torch.device("cpu")
MODULE = cpu_extension.load()  # a required piece of the CPU path: never skipped
ARCHS = sorted(SPARSE_LAYERS)  # mixtral, qwen2_moe, qwen3_moe


def _expert_tokens(model) -> list[torch.Tensor]:
    return [
        layer.mlp.expert_tokens.clone()
        for layer in model.model.layers
        if isinstance(layer.mlp, SparseMoeBlock)
    ]


@pytest.mark.parametrize("pack_linear", [True, False], ids=["onednn", "f_linear"])
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_decode_steps_equal_the_eager_layers_bitwise(arch, pack_linear, tmp_path):
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU, pack_linear=pack_linear)
    assert isinstance(model.model.fused_decode, FusedDecode), attach_fused_decode(model)
    block = model.model.layers[SPARSE_LAYERS[arch][0]].mlp
    assert (block.experts.packed is not None) == pack_linear  # oneDNN per expert, or mm
    _fused_against_eager(model, config)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_decode_steps_through_the_expert_matvec_equal_the_eager_layers_bitwise(arch, tmp_path):
    """With every expert's one to four rows through the C++ ``expert_matvec`` (whatever the
    load-time timing chose), the stack and the eager layers still agree to the bit."""
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU, pack_linear=True)
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.experts.packed.use_matvec(MODULE.expert_matvec, MODULE.MATVEC_MAX_ROWS)
    assert attach_fused_decode(model) is None
    _fused_against_eager(model, config)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bfloat16_moe_decode_steps_equal_the_eager_layers_bitwise(arch, tmp_path):
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, torch.bfloat16, CPU)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    _fused_against_eager(model, config)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_the_stack_counts_expert_load_as_the_eager_block(arch, tmp_path):
    """A decode step through the stack adds to each layer's ``expert_tokens`` what the
    same step through the eager layers adds: top_k pairs per sequence, the same experts."""
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU)
    stack = model.model.fused_decode
    runner, tokens, seqs = _prefill(model, config, torch.Generator().manual_seed(2))
    eager = copy.copy(runner)
    eager.kv_cache = runner.kv_cache.clone()
    before = _expert_tokens(model)
    _decode(runner, tokens, seqs, list(PROMPT_LENS))
    after_fused = _expert_tokens(model)
    model.model.fused_decode = None
    _decode(eager, tokens, seqs, list(PROMPT_LENS))
    after_eager = _expert_tokens(model)
    model.model.fused_decode = stack
    top_k = config.num_experts_per_tok
    for b, f, e in zip(before, after_fused, after_eager, strict=True):
        assert int((f - b).sum()) == top_k * len(seqs)
        assert torch.equal(f - b, e - f)


@pytest.mark.parametrize(
    ("pack_linear", "matvec_rows"),
    [(True, 0), (True, 2), (False, 0)],
    ids=["onednn", "onednn_matvec", "f_linear"],
)
def test_a_moe_block_alone_equals_the_eager_block(pack_linear, matvec_rows, tmp_path):
    """One MoE block (with its shared expert), called directly on 1, 3 and 40 tokens (an
    expert with one row, with a few, with many: the packed experts' dense, oneDNN and
    C++ matvec multiplies), equals SparseMoeBlock.forward to the bit."""
    make_hf_model("qwen2_moe", tmp_path)
    model, _ = load_model(tmp_path, torch.float32, CPU, pack_linear=pack_linear, fused_decode=False)
    block = model.model.layers[SPARSE_LAYERS["qwen2_moe"][0]].mlp
    assert (block.experts.packed is not None) == pack_linear
    if pack_linear:
        block.experts.packed.use_matvec(MODULE.expert_matvec, matvec_rows)
    cpp = _moe_block(block, MODULE)
    gen = torch.Generator().manual_seed(5)
    for num_tokens in (1, 3, 40):
        x = torch.randn(num_tokens, block.experts.hidden_size, generator=gen)
        with torch.inference_mode():
            assert torch.equal(cpp(x), block(x)), num_tokens


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_engine_greedy_through_the_stack_equals_transformers(arch, tmp_path, monkeypatch):
    """`make-model`'s checkpoint, a ragged batch with chunked prefills beside decodes: the
    decode steps go through the stack (counted), and the greedy tokens equal transformers'
    (float32) and the eager engine's."""
    path = make_model(tmp_path, arch, "tiny", overwrite=True)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(11)
    vocab = hf_model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 11, 29, 50, 7)]
    num_new = 16
    expected = [hf_greedy(hf_model, p, num_new) for p in prompts]
    assert all(len(set(want)) > 4 for want in expected), expected
    calls = []
    original = FusedDecode.__call__

    def counting(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    config = dict(dtype="float32", block_size=8, max_num_batched_tokens=24, max_num_seqs=8)
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    fused = [list(o.token_ids) for o in LLM(str(path), **config).generate(prompts, params)]
    assert calls and max(calls) > 1, "no batched decode step went through the stack"
    assert fused == expected
    monkeypatch.setenv("BATON_FUSED_DECODE", "0")
    calls.clear()
    eager = [list(o.token_ids) for o in LLM(str(path), **config).generate(prompts, params)]
    assert not calls and eager == expected


def test_quantized_experts_stay_eager(tmp_path):
    """int4 experts run through grouped_moe, which the stack does not compute: eager."""
    make_hf_model("qwen3_moe", tmp_path)
    model, _ = load_model(tmp_path, torch.float32, CPU, quantization="int4")
    assert model.model.fused_decode is None
    reason = attach_fused_decode(model)
    assert reason is not None and "quantized" in reason
    assert model.model.fused_decode is None
