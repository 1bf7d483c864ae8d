"""The worker's paged KV cache: one block-major tensor.

Layout: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
(see kernels/attention_metadata.py and docs/kv-cache-layout.md). One block of one
request — all layers, K and V — is one contiguous region, so handing a request's
KV to another worker is one descriptor per block (and runs of consecutive block
ids merge into one), instead of ``num_layers * 2`` descriptors per block.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def bytes_per_block(
    num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * num_kv_heads * block_size * head_dim * itemsize


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
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
