"""Attention over the paged KV cache for a flat, unpadded batch (plain-PyTorch reference).

Layouts:
    query:          [num_tokens, num_heads, head_dim]
    kv_cache_layer: [num_blocks, 2, num_kv_heads, block_size, head_dim] (K at index 0 of dim 1)
    returns:        [num_tokens, num_heads, head_dim]

The batch (see ``AttentionMetadata``) holds ``num_decodes`` single-token decodes first, then
the extends. A sequence with context length ``L`` (``seq_lens``, cached + new) and query
length ``q`` has its query token ``i`` at position ``L - q + i``; it attends to every
position ``<= L - q + i``. The new tokens' K/V must already be in the cache (``store_kv``).

Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).

Decodes run as one batched ``scaled_dot_product_attention``: the context is gathered
through the block tables into [num_decodes, Hkv, max_ctx, D] and the ``G`` query heads that
share a KV head are laid out as ``G`` query rows, so GQA needs no K/V expansion and a
length mask is the only mask. Extends run one sequence at a time (their lengths vary a
lot), causally, with a bottom-right-aligned mask when part of the context is cached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def _gather_context(
    kv_cache_layer: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Gather K/V at ``positions`` [num_seqs, ctx_len] -> [num_seqs, ctx_len, 2, Hkv, D]."""
    block_size = kv_cache_layer.shape[3]
    block_ids = torch.gather(block_tables, 1, positions // block_size).long()
    # Advanced indices on dims 0 and 3 around two slices put them first.
    return kv_cache_layer[block_ids, :, :, positions % block_size]


def _decode_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache_layer.shape[2]
    max_ctx_len = max(metadata.seq_lens_cpu[:num_decodes])
    seq_lens = metadata.seq_lens[:num_decodes].to(torch.int64)
    ctx_positions = torch.arange(max_ctx_len, device=query.device)  # [max_ctx]
    # Padding positions re-read the last real token, so no unwritten slot (which may hold
    # NaN/Inf garbage) ever enters the product; the mask then gives them zero weight.
    positions = torch.minimum(ctx_positions[None, :], seq_lens[:, None] - 1)
    kv = _gather_context(kv_cache_layer, metadata.block_tables[:num_decodes], positions)
    key = kv[:, :, 0].transpose(1, 2)  # [num_decodes, Hkv, max_ctx, D]
    value = kv[:, :, 1].transpose(1, 2)  # [num_decodes, Hkv, max_ctx, D]
    # [num_decodes, Hkv, G, D]: the query heads of one KV group become G query rows.
    q = query.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = (ctx_positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [N, 1, 1, max_ctx]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out.view(num_decodes, num_heads, head_dim)


def _extend_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    query_len = query.shape[0]
    ctx_positions = torch.arange(seq_len, device=query.device)  # [seq_len]
    kv = _gather_context(kv_cache_layer, block_table[None, :], ctx_positions[None, :])[0]
    key = kv[:, 0].transpose(0, 1)  # [Hkv, seq_len, D]
    value = kv[:, 1].transpose(0, 1)  # [Hkv, seq_len, D]
    q = query.transpose(0, 1)  # [Hq, query_len, D]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(
            q, key, value, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # Bottom-right aligned: query i sits at position seq_len - query_len + i.
        query_positions = ctx_positions[seq_len - query_len :]
        mask = ctx_positions[None, :] <= query_positions[:, None]  # [query_len, seq_len]
        out = F.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(0, 1)  # [query_len, Hq, D]


def paged_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attend each query token to its sequence's cached context; returns a new tensor.

    Reads ``kv_cache_layer`` only. ``query`` is [num_tokens, num_heads, head_dim].
    """
    num_heads, num_kv_heads = query.shape[1], kv_cache_layer.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    output = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        output[:num_decodes] = _decode_attention(
            query[:num_decodes], kv_cache_layer, metadata, scale
        )
    start = num_decodes
    for seq_idx in range(num_decodes, metadata.num_seqs):
        query_len = metadata.query_lens_cpu[seq_idx]
        end = start + query_len
        output[start:end] = _extend_attention(
            query[start:end],
            kv_cache_layer,
            metadata.block_tables[seq_idx],
            metadata.seq_lens_cpu[seq_idx],
            scale,
        )
        start = end
    return output
