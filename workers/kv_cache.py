"""The worker's paged KV cache: one block-major tensor.

Layout: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
(see kernels/attention_metadata.py and docs/kv-cache-layout.md). One block of one
request — all layers, K and V — is one contiguous region, so handing a request's
KV to another worker is one descriptor per block (and runs of consecutive block
ids merge into one), instead of ``num_layers * 2`` descriptors per block.
"""

from __future__ import annotations

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
    # empty, not zeros: zero-filling gigabytes costs seconds at start-up, and the
    # attention ops never read a slot past a sequence's length (their tests poison
    # the cache with NaN to hold them to that).
    return torch.empty(
        (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), dtype=dtype, device=device
    )


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]] | tuple) -> None:
    """Copy-on-write: whole blocks (every layer, K and V) from src to dst."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=kv_cache.device)
    dst = torch.tensor([d for _, d in copies], device=kv_cache.device)
    kv_cache[dst] = kv_cache[src]
