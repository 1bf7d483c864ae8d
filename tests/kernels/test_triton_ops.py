"""Dispatch of the Triton op set, and the whole engine with Triton kernels against the
reference ops: greedy outputs must be identical (float32).

On CPU the Triton op set runs in the interpreter (the model is tiny); on a CUDA machine the
``gpu`` test runs it compiled, as ``get_kernel_ops`` picks it for CUDA devices.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.kernels.triton_testing import IS_INTERPRETED, require_triton, requires_cuda

require_triton()

from cluster.tools.make_model import make_model  # noqa: E402
from kernels import REFERENCE_OPS, get_kernel_ops, triton_kernel_ops  # noqa: E402
from kernels.triton_attention import paged_attention  # noqa: E402
from kernels.triton_rotary import apply_rotary  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402
from workers.models import loader  # noqa: E402


def test_dispatch_is_chosen_by_device():
    assert not get_kernel_ops(torch.device("cpu")).is_triton
    ops = get_kernel_ops("cpu", use_triton=True)
    assert ops.paged_attention is paged_attention and ops.apply_rotary is apply_rotary
    assert get_kernel_ops("cuda", use_triton=False) is REFERENCE_OPS


@pytest.mark.gpu
@requires_cuda
def test_cuda_gets_triton_ops():
    assert get_kernel_ops(torch.device("cuda")) == triton_kernel_ops()


def write_model(path, arch: str) -> None:
    """A tiny checkpoint with widely spread weights, so greedy choices are not near-ties."""
    make_model(path, arch, "tiny", overwrite=True)
    gen = torch.Generator().manual_seed(1234)
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        noise = torch.randn(tensor.shape, generator=gen)
        weights[name] = (1 + 0.2 * noise if "norm" in name else 0.15 * noise).to(tensor.dtype)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def greedy(path, monkeypatch, use_triton: bool, device: str) -> list[list[int]]:
    monkeypatch.setattr(
        loader, "get_kernel_ops", lambda dev: get_kernel_ops(dev, use_triton=use_triton)
    )
    # A 24-token budget chunks the long prompts; the last two share a 40-token prefix.
    llm = LLM(
        str(path),
        dtype="float32",
        device=device,
        block_size=16,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        max_model_len=256,
        num_kv_blocks=64,
    )
    assert llm.engine.model.model.layers[0].mlp.ops.is_triton == use_triton
    rng = random.Random(7)
    vocab = llm.engine.vocab_size
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 33)]
    prompts += [shared + [rng.randrange(vocab) for _ in range(n)] for n in (5, 12)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


@pytest.mark.skipif(not IS_INTERPRETED, reason="Triton on CPU tensors needs the interpreter")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_matches_reference_ops_cpu(arch, tmp_path, monkeypatch):
    write_model(tmp_path, arch)
    expected = greedy(tmp_path, monkeypatch, use_triton=False, device="cpu")
    assert greedy(tmp_path, monkeypatch, use_triton=True, device="cpu") == expected


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_engine_greedy_matches_reference_ops_cuda(arch, tmp_path, monkeypatch):
    write_model(tmp_path, arch)
    expected = greedy(tmp_path, monkeypatch, use_triton=False, device="cuda")
    assert greedy(tmp_path, monkeypatch, use_triton=True, device="cuda") == expected
