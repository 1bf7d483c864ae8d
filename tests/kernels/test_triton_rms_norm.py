"""Triton rms_norm / fused_add_rms_norm against the reference (outputs NaN-poisoned first)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.triton_testing import (
    DEVICE,
    IS_INTERPRETED,
    require_triton,
    rounding_tolerance,
)

require_triton()

from kernels.rms_norm import fused_add_rms_norm as reference_fused_add_rms_norm  # noqa: E402
from kernels.rms_norm import rms_norm as reference_rms_norm  # noqa: E402
from kernels.triton_rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    # Half precision: the output is rounded twice (normed, then times weight), and rsqrt may
    # differ from PyTorch's in the last bit.
    return rounding_tolerance(dtype, num_roundings=2)


def residual_tolerance(dtype: torch.dtype) -> dict[str, float]:
    # The add is one rounding in both: bit-exact, but for the interpreter's bfloat16 casts.
    if IS_INTERPRETED and dtype == torch.bfloat16:
        return rounding_tolerance(dtype, num_roundings=1)
    return {"atol": 0, "rtol": 0}


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int, strided: bool):
    """x (and a residual) of ``shape``; ``strided`` makes x a view into a wider buffer, as
    the per-head q norm sees the q part of the qkv output."""
    gen = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    if strided:
        wide = torch.randn(*shape[:-2], shape[-2] + 3, hidden, generator=gen) * 3
        x = wide.to(dtype).to(DEVICE)[..., 1 : shape[-2] + 1, :]
        assert not x.is_contiguous()
    else:
        x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    return x, residual, weight


SHAPES = [((7, 64), False), ((5, 3, 80), True), ((2, 3, 4, 96), False), ((3, 4096), False)]


@pytest.mark.parametrize("shape,strided", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(shape, strided, dtype):
    x, _, weight = make_inputs(shape, dtype, seed=len(shape) + shape[-1], strided=strided)
    x_before = x.clone()
    out = torch.full(shape, math.nan, dtype=dtype, device=DEVICE)
    result = rms_norm(x, weight, 1e-5, out=out)
    assert result is out
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-5), **tolerances(dtype))
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("shape,strided", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(shape, strided, dtype):
    x, residual, weight = make_inputs(shape, dtype, seed=shape[-1], strided=strided)
    x_before, residual_before = x.clone(), residual.clone()
    out = torch.full(shape, math.nan, dtype=dtype, device=DEVICE)
    residual_out = torch.full(shape, math.nan, dtype=dtype, device=DEVICE)
    normed, new_residual = fused_add_rms_norm(
        x, residual, weight, 1e-6, out=out, residual_out=residual_out
    )
    assert normed is out and new_residual is residual_out
    expected_normed, expected_residual = reference_fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, expected_residual, **residual_tolerance(dtype))
    torch.testing.assert_close(normed, expected_normed, **tolerances(dtype))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_allocates_contiguous_output():
    x, _, weight = make_inputs((4, 6, 32), torch.float32, seed=1, strided=True)
    out = rms_norm(x, weight, 1e-6)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-6))


def test_rms_norm_rejects_bad_inputs():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(8, dtype=torch.bfloat16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.zeros(2, 4, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
