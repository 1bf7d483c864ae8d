"""An FP8 KV cache (packed uint8 rows: head_dim e4m3 bytes + a float32 scale) as kvtransfer
sees it: its layout, its fingerprint, and a tensor-parallel hand-off that carries each
head's scales with its values."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import LayoutMismatchError
from kvtransfer.layout import check_compatible
from kvtransfer.local_backend import LocalFabric

from .helpers import empty_cache, layout_of, rank_cache
from .test_connector_local import HEADS, Side, connect

HEAD_DIM = 8


def packed_cache(num_blocks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, 2, HEADS, 4, HEAD_DIM + 4)  # layers 2, block size 4
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def test_layout_of_a_packed_cache_names_the_logical_dtype_and_the_scales():
    layout = layout_of(packed_cache(3), HEADS)
    assert (layout.dtype, layout.scale_layout, layout.head_dim) == (
        "float8_e4m3fn",
        "per_token_head_f32",
        HEAD_DIM,
    )
    assert layout.row_bytes == HEAD_DIM + 4
    assert layout.head_bytes == 4 * (HEAD_DIM + 4)  # a head's region holds its scales
    assert layout.block_bytes == 2 * 2 * HEADS * 4 * (HEAD_DIM + 4)


def test_fingerprint_and_check_tell_fp8_from_the_same_shape_unquantized():
    fp8 = layout_of(packed_cache(3), HEADS)
    bf16 = layout_of(torch.zeros(3, 2, 2, HEADS, 4, HEAD_DIM, dtype=torch.bfloat16), HEADS)
    assert fp8.fingerprint != bf16.fingerprint
    with pytest.raises(LayoutMismatchError) as err:
        check_compatible(bf16, fp8)
    assert str(err.value).startswith(
        "incompatible KV layouts (KV cache local bfloat16, remote float8_e4m3fn with "
        "per_token_head_f32 scales)"
    )
    assert "scale_layout: local 'none' != remote 'per_token_head_f32'" in str(err.value)


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_heterogeneous_tp_hand_off_moves_each_heads_values_and_scales(p, d):
    fabric = LocalFabric()
    full = packed_cache(16, seed=4)
    prefills = [Side(fabric, f"p{r}", rank_cache(full, r, p), r, p) for r in range(p)]
    decodes = [Side(fabric, f"d{r}", empty_cache(full, r, d, 16), r, d) for r in range(d)]
    connect(*prefills, *decodes)
    src, dst = [11, 2, 7, 3], [0, 9, 4, 15]
    handles = [side.offer("a", src, dst_tp_size=d) for side in prefills]
    for side in decodes:
        side.conn.receive(handles, dst).result(timeout=5)
    reassembled = torch.cat([side.cache[dst] for side in decodes], dim=3)
    assert torch.equal(reassembled, full[src])
    for side in (*prefills, *decodes):
        side.conn.close()


def test_the_layouts_scale_size_is_the_caches():
    """kvtransfer keeps its own copy of the FP8 row's scale size (kernels/ loads torch, the
    router's bring-up must not): the two must agree, or P and D would disagree on rows."""
    from kernels.fp8_kv import SCALE_BYTES as cache_scale_bytes
    from kvtransfer.layout import SCALE_BYTES as layout_scale_bytes

    assert layout_scale_bytes == cache_scale_bytes
