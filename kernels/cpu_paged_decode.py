"""Decode attention over the paged KV cache in C++ on CPU, reading each K/V row once.

The kernel is ``kernels/csrc/paged_decode.h`` (layouts and the reason there), in the module
that ``kernels/cpu_extension.py`` builds on first use. ``load()`` returns the kernel, or
None where that module cannot be built (logged there); callers then keep the PyTorch
reference (``kernels/paged_attention.py``). ``BATON_CPU_KERNELS=0`` turns it off.

Numerics: float32 scores and sums, like the reference, but in another order (one pass
over positions instead of ``bmm`` tiles) and with a polynomial exponential within 2 ulp
of libm's, so results agree to float rounding, not bits. An FP8 cache's rows are
dequantized exactly as the reference dequantizes them (``kernels/fp8_kv.py``), then read
the same way.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from kernels import cpu_extension
from kernels.timing import fastest


class PagedDecode(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


@functools.cache
def load() -> PagedDecode | None:
    """The built kernel's ``paged_decode``, or None where the module is unavailable."""
    module = cpu_extension.load()
    return None if module is None else module.paged_decode


def measure(decode: PagedDecode, repeats: int = 5) -> tuple[float, float]:
    """(kernel, reference) seconds for one layer's decode attention of 8 decodes of 300
    tokens (4 query heads per KV head, 2 KV heads, head_dim 64, blocks of 16) over a
    float32 cache plus the same over an FP8 one (the op set takes both or neither), the
    minimum of ``repeats`` alternating rounds: a few milliseconds at start-up."""
    from kernels.attention_metadata import build_attention_metadata
    from kernels.fp8_kv import quantize_rows
    from kernels.paged_attention import _decode_attention

    gen = torch.Generator().manual_seed(0)
    num_seqs, seq_len, block_size = 8, 300, 16
    blocks = -(-seq_len // block_size)
    cache = torch.randn(num_seqs * blocks, 2, 2, block_size, 64, generator=gen)
    fp8_cache = quantize_rows(cache)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    query = torch.randn(num_seqs, 8, 64, generator=gen)
    metadata = build_attention_metadata(
        [1] * num_seqs, [seq_len] * num_seqs, tables.numpy(), list(range(num_seqs)), num_seqs
    )
    with torch.inference_mode():
        kernel_s, reference_s = fastest(
            [
                lambda: (
                    decode(query, cache, metadata.block_tables, metadata.seq_lens, 0.125),
                    decode(query, fp8_cache, metadata.block_tables, metadata.seq_lens, 0.125),
                ),
                lambda: (
                    _decode_attention(query, cache, metadata, 0.125),
                    _decode_attention(query, fp8_cache, metadata, 0.125),
                ),
            ],
            repeats,
        )
    return kernel_s, reference_s
