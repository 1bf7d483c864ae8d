"""The C++ few-row expert multiply (kernels/csrc/matvec.h, ``expert_matvec``) against its
PyTorch reference ``x @ w.t()`` within float32 tolerance, on the MoE experts' shapes and on
odd ones (an inner size that is not a multiple of the vector width, a strided ``x``, an
output count that is not a multiple of the output block); its result does not depend on
the thread count; it refuses what it does not compute. And ``choose_matvec_rows`` /
``PackedExperts.use_matvec``: the eager expert goes through it up to the chosen rows."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from kernels.activation import silu_and_mul
from kernels.moe import PackedExperts, choose_matvec_rows

MODULE = cpu_extension.load()  # a required piece of the CPU path: never skipped


@pytest.mark.parametrize(("out", "inner"), [(512, 768), (768, 256), (37, 50), (5, 16), (3, 7)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_expert_matvec_equals_the_matmul(rows, out, inner):
    gen = torch.Generator().manual_seed(rows * 1000 + out + inner)
    w = torch.randn(out, inner, generator=gen)
    x = torch.randn(rows, inner, generator=gen)
    got = MODULE.expert_matvec(x, w)
    assert got.shape == (rows, out) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)


def test_a_strided_x_and_one_thread_give_the_same_bits():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=gen)
    wide = torch.randn(3, 2 * 200, generator=gen)
    x = wide[:, 100:300]  # rows strided by 400, columns unit stride
    want = MODULE.expert_matvec(x.contiguous(), w)
    assert torch.equal(MODULE.expert_matvec(x, w), want)
    torch.testing.assert_close(want, x @ w.t(), rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(MODULE.expert_matvec(x, w), want)
    finally:
        torch.set_num_threads(threads)


def test_expert_matvec_refuses_what_it_does_not_compute():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="rows"):
        MODULE.expert_matvec(torch.randn(MODULE.MATVEC_MAX_ROWS + 1, 16), w)
    with pytest.raises(RuntimeError, match="float32"):
        MODULE.expert_matvec(torch.randn(1, 16, dtype=torch.bfloat16), w.bfloat16())
    with pytest.raises(RuntimeError, match="w"):
        MODULE.expert_matvec(torch.randn(1, 8), w)


def test_packed_experts_use_the_matvec_up_to_the_chosen_rows():
    gen = torch.Generator().manual_seed(4)
    w13, w2 = torch.randn(4, 64, 48, generator=gen), torch.randn(4, 48, 32, generator=gen)
    packed = PackedExperts(w13, w2)
    calls = []

    def matvec(x, w):
        calls.append(x.shape[0])
        return MODULE.expert_matvec(x, w)

    most, timings = choose_matvec_rows([packed], matvec, 3, repeats=1)
    assert 0 <= most <= 3 and 1 <= len(timings) <= 3 and packed.matvec_max_rows == 0
    packed.use_matvec(matvec, 2)
    for rows in (1, 2, 3):
        calls.clear()
        x = torch.randn(rows, 48, generator=gen)
        want = silu_and_mul(x @ w13[1].t()) @ w2[1].t()
        torch.testing.assert_close(packed.mlp(1, x), want, rtol=1e-5, atol=1e-4)
        assert calls == ([rows, rows] if rows <= 2 else [])
    with pytest.raises(ValueError, match="float32"):
        PackedExperts(w13.bfloat16(), w2.bfloat16()).use_matvec(matvec, 1)
