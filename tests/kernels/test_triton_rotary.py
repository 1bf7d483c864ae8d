"""Triton apply_rotary (in place) against the reference (which returns new tensors)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_testing import DEVICE, require_triton

require_triton()

from kernels.rotary import apply_rotary as reference_apply_rotary  # noqa: E402
from kernels.rotary import compute_cos_sin_cache  # noqa: E402
from kernels.triton_rotary import apply_rotary  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    # Half precision: the reference rounds each product, the kernel rounds once.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """q, k, v as the model hands them over: strided views into one fused qkv output."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (7, 1), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_in_place_matches_reference(
    head_dim, rope_scaling, num_heads, num_kv_heads, dtype
):
    num_tokens = 9
    q, k, v = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 63, 64, 65, 300, 511], device=DEVICE)
    cache = compute_cos_sin_cache(head_dim, 512, 10000.0, rope_scaling, dtype).to(DEVICE)
    expected_q, expected_k = reference_apply_rotary(q, k, positions, cache)
    v_before = v.clone()

    q_out, k_out = apply_rotary(q, k, positions, cache)

    assert q_out is q and k_out is k  # rotated in place
    torch.testing.assert_close(q, expected_q, **tolerances(dtype))
    torch.testing.assert_close(k, expected_k, **tolerances(dtype))
    assert torch.equal(v, v_before)  # the rest of the qkv buffer is untouched


def test_partial_rotary_dim_leaves_the_tail():
    q, k, _ = qkv_views(5, 3, 1, 16, torch.float32, seed=3)
    positions = torch.tensor([4, 0, 9, 2, 7], device=DEVICE)
    rotary_dim = 8  # only the first 8 features rotate; the rest pass through
    cache = compute_cos_sin_cache(rotary_dim, 10, 10000.0, None, torch.float32).to(DEVICE)
    expected_q, expected_k = reference_apply_rotary(q, k, positions, cache)
    q_tail, k_tail = q[..., rotary_dim:].clone(), k[..., rotary_dim:].clone()
    apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    assert torch.equal(q[..., rotary_dim:], q_tail) and torch.equal(k[..., rotary_dim:], k_tail)


def test_apply_rotary_rejects_bad_inputs():
    q, k, _ = qkv_views(2, 2, 1, 16, torch.float32, seed=0)
    cache = compute_cos_sin_cache(16, 8, 10000.0, None, torch.float32).to(DEVICE)
    with pytest.raises(ValueError, match="int64"):
        apply_rotary(q, k, torch.zeros(2, dtype=torch.int32, device=DEVICE), cache)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(
            q[..., :8], k[..., :8], torch.zeros(2, dtype=torch.int64, device=DEVICE), cache
        )
