"""Paged KV caches in the worker's layout, sliced by tensor-parallel rank, for the tests."""

from __future__ import annotations

import torch

from kvtransfer.layout import KVLayout, kv_head_range

MODEL = "test-model"


def full_kv(
    num_blocks: int,
    num_layers: int = 2,
    num_kv_heads: int = 4,
    block_size: int = 4,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> torch.Tensor:
    """A whole model's KV (all heads): ``[blocks, layers, 2, heads, bs, dim]``, random."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def rank_cache(full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of ``full`` that ``tp_rank`` holds, as its own contiguous cache tensor."""
    start, end = kv_head_range(full.shape[3], tp_rank, tp_size)
    return full[:, :, :, start:end].contiguous()


def empty_cache(
    like_full: torch.Tensor, tp_rank: int, tp_size: int, num_blocks: int
) -> torch.Tensor:
    start, end = kv_head_range(like_full.shape[3], tp_rank, tp_size)
    shape = (num_blocks, *like_full.shape[1:3], end - start, *like_full.shape[4:])
    return torch.zeros(shape, dtype=like_full.dtype)


def layout_of(
    cache: torch.Tensor, num_kv_heads: int, tp_rank: int = 0, tp_size: int = 1, model_id=MODEL
) -> KVLayout:
    return KVLayout.from_tensor(
        cache, model_id=model_id, num_kv_heads=num_kv_heads, tp_rank=tp_rank, tp_size=tp_size
    )
