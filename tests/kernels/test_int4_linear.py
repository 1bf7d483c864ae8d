"""The CPU int4 kernel (torch's int4-packed matmul) against the dequantize-then-matmul
reference, and the reference against the definition ``(q - zero) * scale``."""

from __future__ import annotations

import pytest
import torch

from kernels import int4_linear


def random_int4(n: int, k: int, group_size: int, seed: int, symmetric: bool = False):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # float16-representable scales, as the published layouts store them
    scales = (torch.rand(n, groups, generator=gen) * 0.05 + 0.01).half().float()
    if symmetric:
        zeros = torch.full((n, groups), 8.0)
    else:
        zeros = torch.randint(0, 16, (n, groups), generator=gen).float()
    return q, scales, zeros


def test_dequantize_follows_the_definition():
    q, scales, zeros = random_int4(5, 37, 16, seed=0)  # ragged last group (37 = 2 * 16 + 5)
    w = int4_linear.dequantize(q, scales, zeros, 16)
    for n, k in [(0, 0), (4, 15), (2, 16), (3, 36)]:
        g = k // 16
        want = (float(q[n, k]) - float(zeros[n, g])) * float(scales[n, g])
        assert w[n, k].item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize(
    "n,k,group_size,symmetric",
    [(64, 256, 128, True), (48, 384, 128, False), (32, 96, 32, False), (16, 512, 256, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_reference(m, n, k, group_size, symmetric, dtype):
    q, scales, zeros = random_int4(n, k, group_size, seed=m + n + k, symmetric=symmetric)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    assert int4_linear.cpu_kernel_supported(n, k, group_size)
    packed, matmul = int4_linear.pack_cpu(q, scales, zeros, group_size)
    assert packed.numel() == n * k // 2  # half a byte per weight
    got = matmul(x, packed, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    # The reference sees what the kernel sees: activations and (scale, zero) in bfloat16.
    want = int4_linear.int4_linear_reference(x.bfloat16().float(), q, scales, zeros, group_size)
    want = want + bias.float()
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * scale)
    # ... and the kernel is far closer to it than to a wrong zero point (off by one).
    wrong = int4_linear.int4_linear_reference(x.float(), q, scales, zeros + 1, group_size)
    assert (got.float() - want).abs().max() < 0.25 * (wrong + bias.float() - want).abs().max()


def test_cpu_kernel_refuses_shapes_it_cannot_take():
    assert not int4_linear.cpu_kernel_supported(40, 256, 128)  # N % 16
    assert not int4_linear.cpu_kernel_supported(64, 200, 128)  # ragged group
    assert not int4_linear.cpu_kernel_supported(64, 240, 48)  # group size
    q, scales, zeros = random_int4(40, 256, 128, seed=0)
    with pytest.raises(ValueError, match=r"\[40, 256\]"):
        int4_linear.pack_cpu(q, scales, zeros, 128)
