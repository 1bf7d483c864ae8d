"""The C++ decoder-layer stack (workers/models/fused_decode.py, kernels/csrc/decode_stack.h)
against the eager layers it replaces for decode steps: the same logits and the same KV
cache, to the bit, on the four architectures (Qwen2's q/k/v bias, Qwen3's per-head norms,
llama3 RoPE scaling, GQA ratios 2 and 4), float32 and bfloat16, plain and oneDNN-packed
and int4 weights, over a poisoned paged cache of the model's dtype or FP8 (per-row and
static scales); where it attaches and where it does not; and the C++ RMSNorm the eager
CPU layers now share with it.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from kernels import REFERENCE_OPS, cpu_extension, cpu_kernel_ops
from kernels.activation import silu_and_mul
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from tests.kernels.paged_batch import build_metadata, positions_for
from tests.workers.test_models import BLOCK_SIZE, CASES, PROMPT_LENS, PagedRunner, make_hf_model
from workers.models import load_model
from workers.models.fused_decode import FusedDecode, attach_fused_decode

CPU = torch.device("cpu")
MODULE = cpu_extension.load()  # a required piece of the CPU path: never skipped


def _prefill(model, config, gen, fp8=False):
    """A runner whose cache holds fresh prompts of PROMPT_LENS tokens (an eager step)."""
    total = [n + 3 for n in PROMPT_LENS]
    runner = PagedRunner(model, config, total)
    if fp8:
        _to_fp8(runner)
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in total]
    seqs = list(range(len(tokens)))
    runner.step(seqs, [t[:n] for t, n in zip(tokens, PROMPT_LENS, strict=True)], PROMPT_LENS)
    return runner, tokens, seqs


def _decode(runner, tokens, seqs, lens):
    """One decode step (token ``lens[s]`` of each sequence): (logits, hidden)."""
    new_ids = [tokens[s][lens[s] : lens[s] + 1] for s in seqs]
    seq_lens = [lens[s] + 1 for s in seqs]
    metadata = build_metadata(
        [1] * len(seqs), seq_lens, [runner.block_tables[s] for s in seqs], BLOCK_SIZE, len(seqs)
    )
    with torch.inference_mode():
        hidden = runner.model(
            torch.cat(new_ids), positions_for([1] * len(seqs), seq_lens), runner.kv_cache, metadata
        )
        return runner.model.compute_logits(hidden)


def _to_fp8(runner):
    """The runner's cache as a poisoned packed FP8 cache (kernels/fp8_kv.py) of its shape."""
    from kernels.fp8_kv import packed_row_bytes

    shape = (*runner.kv_cache.shape[:-1], packed_row_bytes(runner.kv_cache.shape[-1]))
    runner.kv_cache = torch.randint(
        0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(4)
    )
    return runner


def _fused_against_eager(model, config, seed=2, fp8=False):
    """Two decode steps through the stack and through the eager layers, from one prefill:
    logits and the whole cache must agree to the bit."""
    assert isinstance(model.model.fused_decode, FusedDecode)
    calls = []
    stack = model.model.fused_decode
    original = stack.__call__

    def counting(*args):
        calls.append(1)
        return original(*args)

    runner, tokens, seqs = _prefill(model, config, torch.Generator().manual_seed(2), fp8)
    eager = copy.copy(runner)
    eager.kv_cache = runner.kv_cache.clone()
    lens = list(PROMPT_LENS)
    for _ in range(2):
        model.model.fused_decode = _Spy(stack, counting)
        fused_logits = _decode(runner, tokens, seqs, lens)
        model.model.fused_decode = None
        eager_logits = _decode(eager, tokens, seqs, lens)
        model.model.fused_decode = stack
        assert torch.equal(fused_logits, eager_logits)
        assert torch.equal(runner.kv_cache, eager.kv_cache)
        lens = [n + 1 for n in lens]
    assert len(calls) == 2, "the decode steps did not go through the stack"


class _Spy:
    """The stack, counting its calls (``takes`` unchanged)."""

    def __init__(self, stack: FusedDecode, call) -> None:
        self.takes = stack.takes
        self._call = call

    def __call__(self, *args):
        return self._call(*args)


@pytest.mark.parametrize("pack_linear", [True, False], ids=["onednn", "f_linear"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_decode_steps_equal_the_eager_layers_bitwise(arch, pack_linear, tmp_path):
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU, pack_linear=pack_linear)
    _fused_against_eager(model, config)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_decode_steps_equal_the_eager_layers_bitwise(arch, tmp_path):
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, torch.bfloat16, CPU)
    assert model.model.norm.weight.dtype == torch.bfloat16
    _fused_against_eager(model, config)


def test_int4_decode_steps_equal_the_eager_layers_bitwise(tmp_path):
    make_hf_model("qwen2", tmp_path)  # q/k/v bias on top of the int4 kernel
    model, config = load_model(tmp_path, torch.float32, CPU, quantization="int4")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype != torch.float32, "the int4 kernel is the path under test"
    _fused_against_eager(model, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_cache_decode_steps_equal_the_eager_layers_bitwise(arch, dtype, tmp_path):
    """The stack quantizes each K/V row as quantize_rows does and attends over the FP8
    cache as the eager op set's kernel does: the same logits and the same cache bytes."""
    make_hf_model(arch, tmp_path)
    model, config = load_model(tmp_path, dtype, CPU)
    _fused_against_eager(model, config, fp8=True)


def test_fp8_cache_with_static_scales_equals_the_eager_layers_bitwise(tmp_path):
    """A checkpoint's static K/V scales (one per layer; one of them absent on a layer:
    that layer's rows get their own): small enough that some values saturate at 448."""
    make_hf_model("llama", tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU, fused_decode=False)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.attn.k_scale = 0.004 * (i + 1)
        layer.self_attn.attn.v_scale = None if i == 0 else 0.0005
    assert attach_fused_decode(model) is None
    _fused_against_eager(model, config, fp8=True)


def test_steps_it_does_not_take_run_eager(tmp_path):
    make_hf_model("llama", tmp_path)
    model, _ = load_model(tmp_path, torch.float32, CPU)
    fused = model.model.fused_decode
    metadata = build_metadata([1, 3], [5, 9], [[0], [1, 2]], 8, 1)  # a decode and an extend
    cache = torch.zeros(4, 2, 2, 2, 8, 16)
    assert not fused.takes(4, cache, metadata)
    decodes = build_metadata([1, 1], [5, 9], [[0], [1, 2]], 8, 2)
    assert fused.takes(2, cache, decodes)
    assert fused.takes(2, cache.to(torch.uint8), decodes)  # an FP8 cache
    assert not fused.takes(2, cache.double(), decodes)  # not the model's dtype


def test_where_it_does_not_attach(tmp_path, monkeypatch, caplog):
    make_hf_model("llama", tmp_path)
    model, _ = load_model(tmp_path, torch.float32, CPU, fused_decode=False)
    assert model.model.fused_decode is None
    # A linear layer multiplying through anything but the three known kernels.
    layer = model.model.layers[1].mlp.down_proj
    layer.matmul = lambda x, w, b=None: torch.nn.functional.linear(x, w, b) * 1.0
    with caplog.at_level(logging.INFO, logger="workers.models.fused_decode"):
        reason = attach_fused_decode(model)
    assert reason is not None and "multiplies through" in reason
    assert model.model.fused_decode is None and "eager layers" in caplog.text
    # The reference op set (e.g. the C++ decode measured slower here): norms differ.
    plain, _ = load_model(tmp_path, torch.float32, CPU, ops=REFERENCE_OPS)
    assert "op set" in attach_fused_decode(plain) and plain.model.fused_decode is None
    monkeypatch.setenv("BATON_FUSED_DECODE", "0")
    again, _ = load_model(tmp_path, torch.float32, CPU)
    assert again.model.fused_decode is None


def test_not_for_an_architecture_it_does_not_know(tmp_path):
    make_hf_model("llama", tmp_path)
    model, _ = load_model(tmp_path, torch.float32, CPU, fused_decode=False)

    class Other(type(model)):  # e.g. a future model reusing Llama's classes
        pass

    model.__class__ = Other
    assert "is not a Llama" in attach_fused_decode(model)


def test_the_stack_refuses_bad_input(tmp_path):
    make_hf_model("llama", tmp_path)
    model, config = load_model(tmp_path, torch.float32, CPU)
    stack = model.model.fused_decode.stack
    metadata = build_metadata([1], [5], [[0]], 8, 1)
    cache = torch.zeros(2, config.num_hidden_layers, 2, 2, 8, config.head_dim)
    hidden = torch.randn(1, config.hidden_size)
    far = torch.tensor([10_000])
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        stack.forward(hidden, far, cache, metadata.slot_mapping, metadata.block_tables,
                      metadata.seq_lens)  # fmt: skip
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        stack.forward(hidden, torch.tensor([4]), cache, torch.tensor([99]),
                      metadata.block_tables, metadata.seq_lens)  # fmt: skip
    with pytest.raises(RuntimeError, match="model dtype"):
        stack.forward(hidden.double(), torch.tensor([4]), cache, metadata.slot_mapping,
                      metadata.block_tables, metadata.seq_lens)  # fmt: skip
    with pytest.raises(RuntimeError, match="unknown linear kind"):
        MODULE.Linear("fp8", torch.zeros(2, 2), None, None, 0)


def test_the_cpu_op_set_norms_through_cpp():
    ops = cpu_kernel_ops()
    assert ops.is_cpu_kernels and ops.rms_norm is MODULE.rms_norm
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(3, 5, 96, generator=gen).to(dtype)  # leading dims, as q/k norms have
        residual = torch.randn(3, 5, 96, generator=gen).to(dtype)
        weight = (1 + 0.3 * torch.randn(96, generator=gen)).to(dtype)
        torch.testing.assert_close(
            ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), rtol=tol, atol=tol
        )
        got, got_sum = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
        want, want_sum = fused_add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(got_sum, want_sum)  # one rounded add: the same bits
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)


def test_inputs_are_not_mutated_by_the_cpp_norms():
    x, residual, weight = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    x0, r0 = x.clone(), residual.clone()
    MODULE.fused_add_rms_norm(x, residual, weight, 1e-6)
    MODULE.rms_norm(x, weight, 1e-6)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def test_the_cpu_op_set_gates_through_cpp():
    ops = cpu_kernel_ops()
    assert ops.silu_and_mul is MODULE.silu_and_mul
    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        # 3 x 5 rows of 2 x 37: a vector body and a scalar tail; far tails of the SiLU.
        x = (6 * torch.randn(3, 5, 74, generator=gen)).to(dtype)
        x[0, 0, :4] = torch.tensor([-200.0, 200.0, -90.0, 0.0]).to(dtype)
        got, want = ops.silu_and_mul(x), silu_and_mul(x)
        assert got.shape == (3, 5, 37) and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.isfinite(got).all()
    with pytest.raises(RuntimeError, match="must be even"):
        ops.silu_and_mul(torch.randn(2, 7))


def test_the_engine_gives_the_same_tokens_with_and_without_the_stack(tmp_path, monkeypatch):
    """Chunked prefills beside decodes (eager steps) and decode-only steps (the stack)
    interleave; turning the stack off changes no token, and it really ran."""
    from cluster.tools.make_model import make_model
    from workers import LLM, SamplingParams

    path = make_model(tmp_path / "tiny", "llama", "tiny")
    prompts = [[3 + i] * n for i, n in enumerate((5, 40, 90, 17, 63, 2))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    calls = []
    original = FusedDecode.__call__

    def counting(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    # A small step budget: prompts are prefilled in chunks beside running decodes.
    config = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=8)
    fused = [o.token_ids for o in LLM(str(path), **config).generate(prompts, params)]
    assert calls and max(calls) > 1, "no decode step went through the stack"
    monkeypatch.setenv("BATON_FUSED_DECODE", "0")
    calls.clear()
    eager = [o.token_ids for o in LLM(str(path), **config).generate(prompts, params)]
    assert not calls
    assert fused == eager
