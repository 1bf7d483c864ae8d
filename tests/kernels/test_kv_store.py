"""store_kv writes exactly the mapped slots of one layer of the whole cache."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.kv_store import store_kv


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 80), (8, 128)])
def test_store_kv_writes_only_mapped_slots(block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks, num_layers, layer = 9, 3, 1
    # Whole cache, NaN-poisoned: the layer view is non-contiguous, as in the engine.
    kv_cache = torch.full((num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), math.nan)
    num_tokens = 2 * block_size + 5
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[3] = -1  # padding token: skipped
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)

    store_kv(key, value, kv_cache[:, layer], slot_mapping)

    expected = torch.full_like(kv_cache, math.nan)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[slot // block_size, layer, 0, :, slot % block_size] = key[t]
            expected[slot // block_size, layer, 1, :, slot % block_size] = value[t]
    torch.testing.assert_close(kv_cache, expected, equal_nan=True, atol=0, rtol=0)
    assert int((~kv_cache.isnan()).sum()) == 2 * (num_tokens - 1) * num_kv_heads * head_dim


def test_store_kv_rejects_mismatched_shapes():
    cache = torch.zeros(2, 2, 1, 16, 8)
    with pytest.raises(ValueError, match="disagree"):
        store_kv(torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), cache, torch.arange(2))
