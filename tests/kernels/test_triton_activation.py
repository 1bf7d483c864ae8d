"""Triton silu_and_mul against the reference (outputs NaN-poisoned first)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.triton_testing import DEVICE, require_triton, rounding_tolerance

require_triton()

from kernels.activation import silu_and_mul as reference_silu_and_mul  # noqa: E402
from kernels.triton_activation import silu_and_mul  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 16), (13, 688), (4, 2000), (2, 3, 96), (3, 2 * 2500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 4).to(dtype).to(DEVICE)
    x_before = x.clone()
    out = torch.full((*shape[:-1], shape[-1] // 2), math.nan, dtype=dtype, device=DEVICE)
    result = silu_and_mul(x, out=out)
    assert result is out
    # Half precision: two roundings (silu, product); exp may differ in the last bit.
    torch.testing.assert_close(out, reference_silu_and_mul(x), **rounding_tolerance(dtype))
    assert torch.equal(x, x_before)


def test_silu_and_mul_strided_rows():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 40, generator=gen).to(DEVICE)
    x = wide[:, 4:36]  # rows 40 apart, 32 features each
    out = silu_and_mul(x)
    assert out.shape == (6, 16) and out.is_contiguous()
    torch.testing.assert_close(out, reference_silu_and_mul(x))


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))
