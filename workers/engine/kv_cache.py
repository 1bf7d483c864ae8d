"""The worker's paged KV cache: one block-major tensor.

Layout: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
(see kernels/attention_metadata.py and docs/kv-cache-layout.md). One block of one
request — all layers, K and V — is one contiguous region, so handing a request's
KV to another worker is one descriptor per block (and runs of consecutive block
ids merge into one), instead of ``num_layers * 2`` descriptors per block.

With ``kv_cache_dtype: fp8_e4m3`` the tensor is ``uint8`` and its last axis is a packed
row of ``head_dim`` float8_e4m3fn values and their float32 scale (``kernels/fp8_kv.py``):
``head_dim + 4`` bytes per token, kv head, layer and K/V instead of ``2 * head_dim`` (bf16).

A model with multi-head latent attention (DeepSeek, ``kernels/mla_attention.py``) caches one
latent row per token and layer instead of K and V per kv head: ``num_entries`` 1 and one
"head" whose ``head_dim`` is the row (``ArchConfig.kv_cache_*``), so the tensor is
``[num_blocks, num_layers, 1, 1, block_size, kv_lora_rank + qk_rope_head_dim]`` and every
block-wise operation (block manager, prefix cache, copy-on-write, tiers) is unchanged.
"""

from __future__ import annotations

import math
import mmap

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
    num_entries: int = 2,
) -> int:
    """Bytes of one block: ``num_entries`` rows (K and V; MLA: 1) per token, kv head and
    layer."""
    storage, row = cache_storage(dtype, kv_cache_dtype, head_dim)
    itemsize = torch.empty((), dtype=storage).element_size()
    return num_layers * num_entries * num_kv_heads * block_size * row * itemsize


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    num_entries: int = 2,
) -> torch.Tensor:
    """The zero-filled cache ``[num_blocks, num_layers, num_entries, num_kv_heads,
    block_size, row]``; ``num_entries`` 2 (K, V) or 1 (MLA's latent); ``row`` is
    ``head_dim`` or, for FP8, the packed ``head_dim + 4`` bytes (a latent row too: its
    ``kv_lora_rank + qk_rope_head_dim`` values share one scale, kernels/mla_attention.py)."""
    dtype, row = cache_storage(dtype, kv_cache_dtype, head_dim)
    shape = (num_blocks, num_layers, num_entries, num_kv_heads, block_size, row)
    # Zero-filled, so every slot holds a finite value: the attention ops gather whole blocks
    # and rely on masked slots weighing exactly zero (see kernels/paged_attention.py).
    if device.type == "cpu":
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return _zeroed_host_memory(num_bytes).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def _zeroed_host_memory(num_bytes: int) -> torch.Tensor:
    """Zeroed host memory for the cache (uint8), asked for in transparent huge pages.

    An anonymous mapping: the OS hands out zero pages lazily, so a multi-GiB cache costs
    nothing at start-up (torch.zeros would memset it all: ~3 s for 2 GiB here). Huge pages
    (where the kernel's THP setting is ``madvise`` or ``always``) because a decode reads its
    blocks a whole all-layer block apart (737 KB for SmolLM2-135M), one TLB miss per 4 KiB
    page otherwise: measured on the 2-core VM, decode attention at batch 32 and context
    512 took 1.44 instead of 1.72 ms per layer. The tensor keeps the mapping alive."""
    if num_bytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8))  # calloc: lazy too
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]] | tuple) -> None:
    """Copy-on-write: whole blocks (every layer, K and V) from src to dst."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=kv_cache.device)
    dst = torch.tensor([d for _, d in copies], device=kv_cache.device)
    kv_cache[dst] = kv_cache[src]
