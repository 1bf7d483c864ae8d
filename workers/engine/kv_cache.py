"""The worker's paged KV cache: one block-major tensor.

Layout: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
(see kernels/attention_metadata.py and docs/kv-cache-layout.md). One block of one
request — all layers, K and V — is one contiguous region, so handing a request's
KV to another worker is one descriptor per block (and runs of consecutive block
ids merge into one), instead of ``num_layers * 2`` descriptors per block.

With ``kv_cache_dtype: fp8_e4m3`` the tensor is ``uint8`` and its last axis is a packed
row of ``head_dim`` float8_e4m3fn values and their float32 scale (``kernels/fp8_kv.py``):
``head_dim + 4`` bytes per token, kv head, layer and K/V instead of ``2 * head_dim`` (bf16).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels.fp8_kv import packed_row_bytes


def cache_storage(
    dtype: torch.dtype, kv_cache_dtype: str, head_dim: int
) -> tuple[torch.dtype, int]:
    """(element dtype, elements per token row) of the cache tensor: ``(dtype, head_dim)``
    for ``kv_cache_dtype="auto"``, packed FP8 rows ``(uint8, head_dim + 4)`` for "fp8_e4m3"."""
    if kv_cache_dtype == "auto":
        return dtype, head_dim
    if kv_cache_dtype == "fp8_e4m3":
        return torch.uint8, packed_row_bytes(head_dim)
    raise ValueError(f"kv_cache_dtype: must be auto or fp8_e4m3, got {kv_cache_dtype!r}")


def bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    storage, row = cache_storage(dtype, kv_cache_dtype, head_dim)
    itemsize = torch.empty((), dtype=storage).element_size()
    return num_layers * 2 * num_kv_heads * block_size * row * itemsize


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """The zero-filled cache ``[num_blocks, num_layers, 2, num_kv_heads, block_size, row]``;
    ``row`` is ``head_dim`` or, for FP8, the packed ``head_dim + 4`` bytes."""
    dtype, row = cache_storage(dtype, kv_cache_dtype, head_dim)
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, row)
    # Zero-filled, so every slot holds a finite value: the attention ops gather whole blocks
    # and rely on masked slots weighing exactly zero (see kernels/paged_attention.py).
    if device.type == "cpu":
        # calloc'ed by numpy: the OS hands out zero pages lazily, so a multi-GiB cache costs
        # nothing at start-up (torch.zeros would memset it all: ~3 s for 2 GiB here).
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]] | tuple) -> None:
    """Copy-on-write: whole blocks (every layer, K and V) from src to dst."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=kv_cache.device)
    dst = torch.tensor([d for _, d in copies], device=kv_cache.device)
    kv_cache[dst] = kv_cache[src]
