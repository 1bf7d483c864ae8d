"""Triton store_kv against the reference: exactly the mapped slots of one layer are written."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.triton_testing import DEVICE, require_triton

require_triton()

from kernels.kv_store import store_kv as reference_store_kv  # noqa: E402
from kernels.triton_kv_store import store_kv  # noqa: E402


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 80), (8, 128), (7, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(block_size + head_dim + num_kv_heads)
    num_blocks, num_layers, layer = 9, 3, 1
    # The whole cache, NaN-poisoned; the kernel gets the strided layer view, as in the engine.
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    kv_cache = torch.full(shape, math.nan, dtype=dtype, device=DEVICE)
    num_tokens = 2 * block_size + 5
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[3] = -1  # padding token: skipped
    slot_mapping = slot_mapping.to(DEVICE)
    # key/value are strided views into a fused qkv output.
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    key = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim]
    value = qkv[:, 3 * num_kv_heads * head_dim :]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()

    expected = kv_cache.clone()
    reference_store_kv(key, value, expected[:, layer], slot_mapping)
    store_kv(key, value, kv_cache[:, layer], slot_mapping)

    torch.testing.assert_close(kv_cache, expected, equal_nan=True, atol=0, rtol=0)
    num_written = int((~kv_cache.isnan()).sum())
    assert num_written == 2 * (num_tokens - 1) * num_kv_heads * head_dim


def test_store_kv_rejects_bad_inputs():
    cache = torch.zeros(2, 2, 1, 16, 8, device=DEVICE)
    key = torch.zeros(3, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="disagree"):
        store_kv(key, key, cache, torch.arange(2, device=DEVICE))
    with pytest.raises(ValueError, match="int64"):
        store_kv(key, key, cache, torch.arange(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="dtypes differ"):
        store_kv(key.bfloat16(), key.bfloat16(), cache, torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        store_kv(key[..., :4], key[..., :4], cache, torch.arange(3, device=DEVICE))
