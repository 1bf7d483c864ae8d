"""oneDNN linear over a packed weight (kernels/cpu_linear.py) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear

# Skips follow torch's own checks, never the probe under test: a probe broken into saying
# "not supported" must fail here, not skip.
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@needs_onednn
def test_probe_agrees_with_torchs_own_checks():
    assert cpu_linear.packing_supported(torch.float32)
    bf16, fp16 = (
        torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    )
    assert cpu_linear.packing_supported(torch.bfloat16) == bf16
    assert cpu_linear.packing_supported(torch.float16) == fp16


@needs_onednn
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 7, 33, 300])
@pytest.mark.parametrize("has_bias", [True, False])
def test_matches_f_linear(num_rows, has_bias):
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 72, generator=gen)
    bias = torch.randn(96, generator=gen) if has_bias else None
    x = torch.randn(num_rows, 72, generator=gen)
    packed = cpu_linear.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    with torch.inference_mode():
        got = cpu_linear.linear(x, packed, bias)
    assert got.shape == (num_rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_strided_and_batched_inputs():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen)
    packed = cpu_linear.pack(weight.t().contiguous().t())  # a transposed view packs the same
    x = torch.randn(24, 10, generator=gen).t()  # [10, 24], column-major
    torch.testing.assert_close(cpu_linear.linear(x, packed), F.linear(x, weight))
    x3 = torch.randn(2, 5, 24, generator=gen)
    torch.testing.assert_close(cpu_linear.linear(x3, packed), F.linear(x3, weight))


@needs_onednn
def test_bfloat16_matches_when_supported():
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("torch: no bfloat16 oneDNN on this CPU")
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 48, generator=gen).bfloat16()
    x = torch.randn(9, 48, generator=gen).bfloat16()
    got = cpu_linear.linear(x, cpu_linear.pack(weight))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="2-D CPU weight"):
        cpu_linear.pack(torch.randn(8))


@pytest.mark.parametrize(
    "plain,packed,expected",
    [
        ((10e-6, 100e-6), (5e-6, 50e-6), True),  # faster at both row counts
        ((10e-6, 100e-6), (20e-6, 200e-6), False),  # slower at both
        ((10e-6, 100e-6), (14.7e-6, 40e-6), True),  # 1.47x slower at 1 row, 2.5x faster batched
        ((10e-6, 100e-6), (14.7e-6, 91e-6), False),  # the Intel VM: 1.47x slower, 1.1x faster
    ],
)
def test_packing_is_chosen_by_its_relative_cost(plain, packed, expected):
    assert cpu_linear.PackingChoice(32, plain, packed).use_packed is expected


@needs_onednn
def test_measure_packing_times_both_kernels():
    weight = torch.randn(256, 128)
    choice = cpu_linear.measure_packing(weight, rows=8, repeats=2)
    assert choice.rows == 8
    assert all(s > 0 for s in (*choice.plain_s, *choice.packed_s))
    assert "F.linear" in choice.describe() and "1 / 8 rows" in choice.describe()
