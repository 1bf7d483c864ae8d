"""silu_and_mul against the plain formula."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul


@pytest.mark.parametrize("num_tokens,intermediate_size", [(1, 8), (13, 344), (4, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(num_tokens, intermediate_size, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(num_tokens, 2 * intermediate_size, generator=gen) * 4).to(dtype)
    gate, up = x[:, :intermediate_size].double(), x[:, intermediate_size:].double()
    expected = gate / (1 + torch.exp(-gate)) * up
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate_size) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
