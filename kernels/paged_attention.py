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

Precondition: every slot of the cache holds a finite value (the engine zero-fills the cache
when it allocates it). Positions past a sequence's length are gathered along with their block
and masked out of the softmax; a weight of exactly zero times a finite value adds nothing.

Context is gathered **by whole blocks** through the block table: indexing the layer view
permuted to [2, Hkv, num_blocks, block_size, D] copies contiguous block_size*D tiles and yields,
per (kv head, sequence), a [context, D] matrix with a uniform row stride — ready for ``bmm``
with no second copy. Decodes run as batched pairs of ``bmm``s where the G query heads that
share a KV head are G query rows (GQA without expanding K/V), one pair per **group** of
decodes of similar context length (``AttentionMetadata.decode_groups``): each group is padded
to its own longest context, not the batch's, and its gathered K/V stays small enough to be
in cache when the ``bmm``s read it. An FP8 cache (``uint8``, ``kernels/fp8_kv.py``) is
dequantized right after the gather, to the query's dtype, so only the blocks a step reads
are ever widened. Extends run one sequence at a time (their lengths vary a
lot), causally, with a bottom-right-aligned mask when part of the context is cached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from kernels.fp8_kv import dequantize_rows, is_fp8_cache, unpacked_head_dim


def _gather_blocks(
    kv_cache_layer: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Copy whole blocks: [num_blocks, 2, Hkv, bs, D] by ids [..., nb] -> [2, Hkv, ..., nb, bs, D]
    (an FP8 cache's rows dequantized to ``dtype``)."""
    _, two, num_kv_heads, block_size, row = kv_cache_layer.shape
    is_fp8 = is_fp8_cache(kv_cache_layer)
    if is_fp8:
        # Packed rows (head_dim + 4 bytes, a multiple of 4) move as int32: index_select
        # copies byte-wide elements one at a time, 4x the work for the same bytes.
        kv_cache_layer = kv_cache_layer.view(torch.int32)
    by_head = kv_cache_layer.permute(1, 2, 0, 3, 4)  # a view: [2, Hkv, num_blocks, bs, D]
    gathered = by_head.index_select(2, block_ids.reshape(-1).long())
    if not is_fp8:
        return gathered.view(two, num_kv_heads, *block_ids.shape, block_size, row)
    gathered = gathered.view(torch.uint8).view(two, num_kv_heads, *block_ids.shape, block_size, row)
    return dequantize_rows(gathered, dtype)


# What a group of decodes costs beyond its padded K/V, and the most K/V one group gathers,
# in bytes: chosen by a sweep on the CPU this path serves (bench/decode_groups.py,
# bench/RESULTS.md). At 2 KiB per token and layer (4 kv heads of 64, float32): 2048 tokens.
_GROUP_COST_BYTES = 4 << 20
_GROUP_MAX_BYTES = 4 << 20


def _decode_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_decodes, _, head_dim = query.shape
    two, num_kv_heads = kv_cache_layer.shape[1], kv_cache_layer.shape[2]
    # What a group gathers, once dequantized: the query's dtype.
    token_bytes = two * num_kv_heads * head_dim * query.element_size()
    groups = metadata.decode_groups(
        _GROUP_COST_BYTES // token_bytes, _GROUP_MAX_BYTES // token_bytes
    )
    tables, seq_lens = metadata.block_tables[:num_decodes], metadata.seq_lens[:num_decodes]
    if groups[0].rows is None:  # one group: the whole batch, in order
        return _padded_decode(query, kv_cache_layer, tables, seq_lens, groups[0].max_seq_len, scale)
    output = torch.empty_like(query)
    for group in groups:
        rows = group.rows
        output.index_copy_(
            0,
            rows,
            _padded_decode(
                query.index_select(0, rows),
                kv_cache_layer,
                tables.index_select(0, rows),
                seq_lens.index_select(0, rows),
                group.max_seq_len,
                scale,
            ),
        )
    return output


def _padded_decode(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Decodes padded to ``max_seq_len``: one pair of ``bmm``s over their gathered blocks."""
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    group = num_heads // num_kv_heads
    num_blocks = -(-max_seq_len // block_size)
    ctx_len = num_blocks * block_size
    batch = num_kv_heads * num_decodes
    kv = _gather_blocks(kv_cache_layer, block_tables[:, :num_blocks], query.dtype)
    kv = kv.view(2, batch, ctx_len, head_dim)  # [2, Hkv * N, ctx, D], kv-head-major
    # [Hkv * N, G, D]: the query heads of one KV group become G query rows.
    q = query.view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1)
    scores = torch.bmm(q.reshape(batch, group, head_dim), kv[0].transpose(1, 2))
    scores = scores.view(num_kv_heads, num_decodes, group, ctx_len).mul_(scale)
    positions = torch.arange(ctx_len, device=query.device)
    beyond = positions[None, :] >= seq_lens[:, None]  # [N, ctx]
    scores.masked_fill_(beyond[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, group, ctx_len)
    out = torch.bmm(probs, kv[1]).view(num_kv_heads, num_decodes, group, head_dim)
    return out.transpose(0, 1).reshape(num_decodes, num_heads, head_dim)


def _extend_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    query_len, _, head_dim = query.shape
    block_size = kv_cache_layer.shape[3]
    num_blocks = -(-seq_len // block_size)
    kv = _gather_blocks(kv_cache_layer, block_table[:num_blocks], query.dtype)
    kv = kv.view(2, kv.shape[1], num_blocks * block_size, head_dim)[:, :, :seq_len]
    # A batch dim of 1: torch runs 4-D inputs through its fused CPU kernel (flash attention)
    # and 3-D ones through the unfused math path, 3x slower at 500 tokens.
    key, value = kv[0][None], kv[1][None]  # [1, Hkv, seq_len, D]
    q = query.transpose(0, 1)[None]  # [1, Hq, query_len, D]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(
            q, key, value, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # Bottom-right aligned: query i sits at position seq_len - query_len + i.
        ctx_positions = torch.arange(seq_len, device=query.device)
        query_positions = ctx_positions[seq_len - query_len :]
        mask = ctx_positions[None, :] <= query_positions[:, None]  # [query_len, seq_len]
        out = F.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)  # [query_len, Hq, D]


DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]  # (query, kv_cache_layer, block_tables, seq_lens, scale) -> out, for the decodes


def paged_attention(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    decode_fn: DecodeFn | None = None,
) -> torch.Tensor:
    """Attend each query token to its sequence's cached context; returns a new tensor.

    Reads ``kv_cache_layer`` only. ``query`` is [num_tokens, num_heads, head_dim].
    ``decode_fn``: computes the decodes instead of the reference's gather-and-``bmm``
    (the C++ kernel of ``kernels/cpu_paged_decode.py``, which reads an FP8 cache too).
    """
    num_heads, num_kv_heads = query.shape[1], kv_cache_layer.shape[2]
    cache_head_dim = kv_cache_layer.shape[4]
    if is_fp8_cache(kv_cache_layer):
        cache_head_dim = unpacked_head_dim(kv_cache_layer)
    if cache_head_dim != query.shape[2]:
        raise ValueError(f"query head_dim {query.shape[2]} != the cache's {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    output = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes and decode_fn is not None:
        output[:num_decodes] = decode_fn(
            query[:num_decodes], kv_cache_layer, metadata.block_tables, metadata.seq_lens, scale
        )
    elif num_decodes:
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
