"""Attention over the paged KV cache for a flat batch (Triton): the ``KernelOps.paged_attention``
that CUDA devices run, with the reference's signature (``kernels/paged_attention.py``).

The batch's leading ``num_decodes`` sequences (one query token each) go to the
flash-decoding kernel (``triton_paged_decode``), the extends to the prefill kernel
(``triton_prefill_attention``); both write into one output tensor. The host-side lengths of
``AttentionMetadata`` size the launches, so nothing waits on the device.
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.triton_paged_decode import paged_decode_attention
from kernels.triton_prefill_attention import prefill_attention


def paged_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend each query token to its sequence's cached context; returns ``out`` (new if None).

    Reads ``kv_cache_layer`` only. ``query`` is [num_tokens, num_heads, head_dim]; the new
    tokens' K/V must already be in the cache.
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_decodes = metadata.num_decodes
    if num_decodes:
        paged_decode_attention(
            query[:num_decodes],
            kv_cache_layer,
            metadata.block_tables[:num_decodes],
            metadata.seq_lens[:num_decodes],
            max(metadata.seq_lens_cpu[:num_decodes]),
            scale,
            out=out[:num_decodes],
        )
    if num_decodes < metadata.num_seqs:
        # query_start_loc keeps absolute row offsets, so the extends index the full query.
        prefill_attention(
            query,
            kv_cache_layer,
            metadata.block_tables[num_decodes:],
            metadata.seq_lens[num_decodes:],
            metadata.query_start_loc[num_decodes:],
            max(metadata.query_lens_cpu[num_decodes:]),
            scale,
            out=out,
        )
    return out
