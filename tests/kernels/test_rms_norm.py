"""rms_norm / fused_add_rms_norm against a naive version and Hugging Face's LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.rms_norm import fused_add_rms_norm, rms_norm


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.double()
    normed = x32 / torch.sqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps)
    return (weight.double() * normed).to(x.dtype)


@pytest.mark.parametrize("shape", [(7, 64), (5, 3, 80), (1, 4096)])
def test_rms_norm_matches_naive(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), naive_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_bitwise_equal_to_hf(dtype):
    gen = torch.Generator().manual_seed(1)
    hf = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=gen))
    hf = hf.to(dtype)
    x = (torch.randn(11, 96, generator=gen) * 2).to(dtype)
    with torch.no_grad():
        expected = hf(x)
    out = rms_norm(x, hf.weight, 1e-5)
    assert out.dtype == dtype
    assert torch.equal(out, expected)


def test_fused_add_rms_norm():
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(2, 9, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, x_before + residual_before)
    torch.testing.assert_close(normed, naive_rms_norm(x_before + residual_before, weight, 1e-6))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
