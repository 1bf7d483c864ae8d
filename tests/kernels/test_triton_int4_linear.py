"""Triton int4 dequantize-matmul against the reference (interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_int4_linear import random_int4
from tests.kernels.triton_testing import DEVICE, bf16_dots_in_interpreter, require_triton

require_triton()

from kernels.int4_linear import int4_linear_reference  # noqa: E402
from kernels.triton_int4_linear import int4_linear, pack  # noqa: E402


@pytest.mark.parametrize(
    "m,n,k,group_size,has_bias",
    [
        (1, 64, 128, 128, False),  # decode, one group
        (3, 72, 200, 64, True),  # ragged N tile, K not a multiple of 8 or of the group
        (17, 40, 96, 32, False),  # M over one tile
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_int4_linear_matches_reference(m, n, k, group_size, has_bias, dtype):
    q, scales, zeros = random_int4(n, k, group_size, seed=m * n + k)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    packed, matmul = pack(q.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group_size)
    with bf16_dots_in_interpreter():  # the interpreter's bf16 tl.dot reads raw bits
        got = matmul(x.to(DEVICE), packed, None if bias is None else bias.to(DEVICE))
    want = int4_linear_reference(x, q, scales, zeros, group_size, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: x and the weights rounded
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=0, atol=tol * scale)


def test_triton_int4_linear_checks_its_inputs():
    q, scales, zeros = random_int4(32, 64, 32, seed=0)
    packed, _ = pack(q.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32)
    x = torch.randn(2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="48 input features"):
        int4_linear(x, packed, scales.t().contiguous(), zeros.t().contiguous(), 32, 64)


@pytest.mark.slow  # the whole model interpreted: ~25 s
def test_int4_model_on_the_triton_op_set_matches_the_reference(tmp_path):
    # The CUDA path end to end (reader -> Triton packing -> layer matmul), here interpreted:
    # a GPTQ checkpoint whose layers' shapes the CPU kernel would also take.
    from cluster.tools.make_model import make_model
    from kernels import get_kernel_ops
    from tests.workers.test_models import PagedRunner
    from workers.models import load_model
    from workers.models.quant.export import quantize_checkpoint

    path = make_model(tmp_path / "gptq", "llama", "tiny")
    quantize_checkpoint(path, "int4-gptq-asym", 32)
    ids = torch.arange(1, 12)
    logits = {}
    for use_triton in (False, True):
        # the Triton side on the GPU where there is one (compiled kernels take no CPU tensor)
        device = DEVICE if use_triton else torch.device("cpu")
        ops = get_kernel_ops(device, use_triton=use_triton)
        model, config = load_model(path, torch.float32, device, ops=ops)
        gate_up = model.model.layers[0].mlp.gate_up_proj
        assert gate_up.weight.dtype == (torch.int32 if use_triton else torch.uint8)
        with bf16_dots_in_interpreter():
            step = PagedRunner(model, config, [len(ids)]).step([0], [ids], [11])
            logits[use_triton] = step[0].cpu()
    # the CPU kernel rounds activations to bfloat16; the Triton kernel runs float32 (ieee)
    scale = logits[False].abs().max().item()
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=3e-2 * scale)
