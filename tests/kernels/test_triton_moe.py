"""Triton fused MoE against the reference (kernels/moe.py; interpreted on CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.kernels.triton_testing import (
    DEVICE,
    IS_INTERPRETED,
    bf16_dots_in_interpreter,
    require_triton,
    requires_cuda,
)

require_triton()

from kernels.moe import fused_moe as reference_fused_moe  # noqa: E402
from kernels.triton_moe import LaunchConfig, align_pairs, fused_moe  # noqa: E402


def moe_layer(num_experts, hidden_size, intermediate_size, dtype, seed):
    """Random ``w13`` [E, 2I, H] and ``w2`` [E, H, I], scaled so outputs stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=gen)
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=gen)
    return (w13 * hidden_size**-0.5).to(dtype), (w2 * intermediate_size**-0.5).to(dtype)


def routing(num_tokens, top_k, experts, seed):
    """Float32 weights and int64 ids, each token's ``top_k`` distinct ids drawn from the
    list ``experts`` (those left out receive no token)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = torch.stack(
        [pool[torch.randperm(len(experts), generator=gen)[:top_k]] for _ in range(num_tokens)]
    )
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    return weights, ids


@contextlib.contextmanager
def rounded_bf16_casts_in_interpreter() -> Iterator[None]:
    """Test-only shim: float32 -> bfloat16 casts in the interpreter round to nearest even, as
    compiled kernels and PyTorch do (the interpreter, 3.7.1, truncates). The kernel rounds
    five times on the way (gate, up, SiLU, product, down); truncating each drifts 3x further
    from float32 than the reference, and with this shim they agree to the bit here."""
    if not IS_INTERPRETED:
        yield
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # finite values: ours are
        return TensorHandle(rounded.astype(np.uint16), tl.bfloat16)

    InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        InterpreterBuilder.cast_impl = original


def run(hidden, w13, w2, weights, ids, first_expert=0, **kwargs):
    # The interpreter's bf16 tl.dot reads raw bits, and its casts truncate: both shimmed.
    with bf16_dots_in_interpreter(), rounded_bf16_casts_in_interpreter():
        out = fused_moe(
            hidden.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE),
            first_expert, **kwargs,
        )  # fmt: skip
    return out.cpu()


def assert_matches(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    # bfloat16: the gate-up and down products are rounded, and a rounding may flip by an
    # ulp with the kernel's summation order; float32 differs by the order alone.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(
    "num_experts,top_k,experts",
    [
        (4, 1, [0, 2, 3]),  # expert 1 receives nothing
        (8, 2, [0, 1, 3, 4, 6]),  # experts 2, 5 and 7 receive nothing
        (4, 2, [0, 1, 2, 3]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, experts, dtype):
    hidden_size, intermediate_size = 48, 40  # neither a multiple of the tiles
    seed = num_tokens * 10 + num_experts + top_k
    w13, w2 = moe_layer(num_experts, hidden_size, intermediate_size, dtype, seed)
    weights, ids = routing(num_tokens, top_k, experts, seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(1))
    hidden = hidden.to(dtype)
    got = run(hidden, w13, w2, weights, ids)
    assert_matches(got, reference_fused_moe(hidden, w13, w2, weights, ids), dtype)


def test_fused_moe_holds_a_slice_of_the_experts():
    # Expert parallelism: 16 experts over 4 ranks of 4. A rank adds exactly its experts'
    # share (tokens routed wholly elsewhere get exact zeros), and the ranks sum to the layer.
    num_tokens, top_k, hidden_size, intermediate_size = 33, 2, 48, 40
    w13, w2 = moe_layer(16, hidden_size, intermediate_size, torch.float32, seed=3)
    weights, ids = routing(num_tokens, top_k, list(range(16)), seed=3)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(4))
    whole = run(hidden, w13, w2, weights, ids)
    total = torch.zeros_like(whole)
    for first in range(0, 16, 4):
        local = slice(first, first + 4)
        got = run(hidden, w13[local], w2[local], weights, ids, first)
        want = reference_fused_moe(hidden, w13[local], w2[local], weights, ids, first)
        assert_matches(got, want, torch.float32)
        is_elsewhere = ((ids < first) | (ids >= first + 4)).all(dim=1)
        assert is_elsewhere.any() and (got[is_elsewhere] == 0).all()
        total += got
    assert_matches(whole, reference_fused_moe(hidden, w13, w2, weights, ids), torch.float32)
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-5 * whole.abs().max().item())


def test_fused_moe_strided_inputs_and_several_blocks_per_expert():
    # A column slice of a wider activation, w2 stored transposed, and 16 x 16 x 16 tiles
    # over 2 experts: each expert's run spans several blocks, every loop several steps.
    num_tokens, hidden_size, intermediate_size = 33, 80, 72
    w13, w2 = moe_layer(2, hidden_size, intermediate_size, torch.float32, seed=5)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    weights, ids = routing(num_tokens, 2, [0, 1], seed=5)
    wide = torch.randn(num_tokens, hidden_size + 8, generator=torch.Generator().manual_seed(6))
    hidden = wide[:, 8:]
    config = LaunchConfig(block_m=16, block_n=16, block_k=16)
    got = run(hidden, w13, w2_t, weights, ids, config=config)
    assert_matches(got, reference_fused_moe(hidden, w13, w2, weights, ids), torch.float32)


def test_align_pairs_pads_each_expert_to_whole_blocks():
    # Pairs (flattened ids): 0->e1 1->e0 2->e1 3->e3 4->e5 (held elsewhere) 5->e1.
    ids = torch.tensor([[1, 0], [1, 3], [5, 1]])
    sorted_pair_ids, block_experts = align_pairs(ids, 0, 4, block_m=2)
    pad = 6
    assert sorted_pair_ids.tolist() == [1, pad, 0, 2, 5, pad, 3, pad] + [pad] * 6
    assert block_experts.tolist() == [0, 1, 1, 3, -1, -1, -1]
    # With an offset: global experts 1..2 held as local 0..1.
    sorted_pair_ids, block_experts = align_pairs(ids, 1, 2, block_m=2)
    assert sorted_pair_ids.tolist()[:4] == [0, 2, 5, pad]
    assert block_experts.tolist()[:2] == [0, 0] and set(block_experts.tolist()[2:]) == {-1}


def test_fused_moe_checks_its_inputs():
    w13, w2 = moe_layer(4, 48, 40, torch.float32, seed=0)
    weights, ids = routing(3, 2, [0, 1, 2, 3], seed=0)
    hidden = torch.randn(3, 48)
    cases = [
        ((hidden[:, :32], w13, w2, weights, ids), "do not fit hidden size 32"),
        ((hidden, w13, w2[:, :, :16], weights, ids), r"want \[E, 2I, H\]"),
        ((hidden, w13.bfloat16(), w2, weights, ids), "must be hidden's dtype"),
        ((hidden.double(), w13.double(), w2.double(), weights, ids), "float32, bfloat16"),
        ((hidden, w13, w2, weights.bfloat16(), ids), "topk_weights must be float32"),
        ((hidden, w13, w2, weights, ids.float()), "topk_ids must be int64 or int32"),
        ((hidden, w13, w2, weights[:, :1], ids), r"must both be \[3, top_k\]"),
        ((hidden[0], w13, w2, weights, ids), r"want hidden \[T, H\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_moe(*args)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [4, 1024])  # the decode and the prefill tiles
def test_fused_moe_large_compiled(num_tokens):
    num_experts, top_k, hidden_size, intermediate_size = 8, 2, 1024, 1408
    w13, w2 = moe_layer(num_experts, hidden_size, intermediate_size, torch.bfloat16, seed=7)
    weights, ids = routing(num_tokens, top_k, list(range(num_experts)), seed=7)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(8))
    hidden = hidden.bfloat16()
    args = [t.to(DEVICE) for t in (hidden, w13, w2, weights, ids)]
    got = fused_moe(*args)
    assert_matches(got.cpu(), reference_fused_moe(*args).cpu(), torch.bfloat16)
    assert torch.equal(fused_moe(*args), got)  # no atomics: the same bits every run
