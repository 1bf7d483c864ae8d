"""Multi-head latent attention (DeepSeek-V2/V3) over the paged *latent* cache (PyTorch
reference).

MLA caches one row per token and layer, shared by every head: the normalised latent
``c_kv`` (``kv_lora_rank`` values, from which each head's key and value are expanded by
``kv_b_proj``) followed by the rotated RoPE key ``k_pe`` (``qk_rope_head_dim``), 576
elements in DeepSeek-V3. No head axis, no separate V (docs/mla.md).

Layouts:
    kv_cache:       [num_blocks, num_layers, 1, 1, block_size, row]  (the engine's block-major
                    cache with the K/V and head axes of size 1; ``row = R + P``)
    latent_cache:   [num_blocks, block_size, row], one layer's strided view
                    ``kv_cache[:, layer, 0, 0]`` (:func:`latent_layer`)
    latent:         [num_tokens, row], ``cat(c_kv, k_pe)``
    slot_mapping:   [num_tokens] int64, ``slot = block_id * block_size + offset``; negative:
                    not stored

With ``kv_cache_dtype: fp8_e4m3`` the cache is ``uint8`` and each row is packed as every
FP8 row is (``kernels/fp8_kv.py``): its ``R + P`` float8_e4m3fn values, then one float32
scale (``amax / 448`` of the row), 580 bytes for DeepSeek-V3 where vLLM's ``fp8_ds_mla``
takes 656 (four scales for ``c_kv``, ``k_pe`` kept in bfloat16; docs/mla.md weighs the two).

Decode attends on the latents directly (the "absorbed" form): a query already multiplied
into latent space, ``q = cat(q_nope @ W_UK, q_pe)`` [N, H, R + P], scores every cached row
(``q . row`` = ``q_nope . k_nope + q_pe . k_pe``), and the output is the weighted sum of the
rows' first ``R`` values, ``[N, H, R]``, which the model takes through ``W_UV``. Prefill
chunks either gather a sequence's rows (:func:`gather_latent`) and expand them
(workers/models/mla.py), or attend on the rows in the same absorbed form, causally
(:func:`mla_prefill_attention`: the definition the Triton prefill kernel is tested against).
Like ``kernels/paged_attention.py``, decodes gather whole blocks padded to the group's
longest context and mask the rest; the engine zero-fills the cache so masked slots are
finite.
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.fp8_kv import dequantize_rows, is_fp8_cache, quantize_rows, unpacked_head_dim

# The most latent rows one padded group of decodes gathers at once (bytes): as the paged
# reference's decode groups (kernels/paged_attention.py), so the bmms read them from cache.
_GROUP_COST_BYTES = 4 << 20
_GROUP_MAX_BYTES = 4 << 20


def latent_layer(kv_cache: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Layer ``layer_idx``'s view [num_blocks, block_size, row] of an MLA cache
    [num_blocks, num_layers, 1, 1, block_size, row]; ValueError for another layout."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(
            "an MLA model needs the latent cache [num_blocks, num_layers, 1, 1, block_size, "
            f"kv_lora_rank + qk_rope_head_dim], got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_floating_point() and not is_fp8_cache(kv_cache):
        raise ValueError(f"a latent cache of {kv_cache.dtype}: float or packed FP8 (uint8)")
    return kv_cache[:, layer_idx, 0, 0]


def latent_width(latent_cache: torch.Tensor) -> int:
    """Values per latent row, ``R + P``: the row's width, less the scale of an FP8 row."""
    return unpacked_head_dim(latent_cache) if is_fp8_cache(latent_cache) else latent_cache.shape[-1]


def as_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows [..., row] as ``dtype`` values [..., R + P]: dequantized (FP8) or cast."""
    return dequantize_rows(rows, dtype) if is_fp8_cache(rows) else rows.to(dtype)


def store_latent(
    latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``latent`` [T, row] into ``latent_cache`` at ``slot_mapping``; mutates the
    cache only."""
    block_size = latent_cache.shape[1]
    if latent.shape[0] != slot_mapping.shape[0] or latent.shape[1] != latent_width(latent_cache):
        raise ValueError(
            f"store_latent: latent {tuple(latent.shape)}, cache {tuple(latent_cache.shape)} "
            f"and slot_mapping {tuple(slot_mapping.shape)} disagree"
        )
    is_valid = slot_mapping >= 0
    if not bool(is_valid.all()):
        latent, slot_mapping = latent[is_valid], slot_mapping[is_valid]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    # FP8: each row quantized with its own scale, the bytes kernels/fp8_kv.py defines.
    rows = quantize_rows(latent) if is_fp8_cache(latent_cache) else latent.to(latent_cache.dtype)
    latent_cache[block_ids, slot_mapping - block_ids * block_size] = rows


def gather_latent(
    latent_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """One sequence's first ``seq_len`` rows as ``dtype`` values [seq_len, R + P] (a new
    tensor), by whole blocks."""
    block_size, row = latent_cache.shape[1], latent_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = latent_cache.index_select(0, block_table[:num_blocks].long())
    return as_values(blocks.reshape(num_blocks * block_size, row)[:seq_len], dtype)


def _padded_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Decodes padded to ``max_seq_len``: one pair of ``bmm``s over their gathered rows."""
    num_decodes = q.shape[0]
    block_size, row = latent_cache.shape[1], latent_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    ctx_len = num_blocks * block_size
    rows = latent_cache.index_select(0, block_tables[:, :num_blocks].reshape(-1).long())
    rows = as_values(rows.view(num_decodes, ctx_len, row), q.dtype)  # [N, ctx, R + P]
    # Every head of a sequence reads the same rows: the heads are the bmm's query rows.
    scores = torch.bmm(q, rows.transpose(1, 2)).mul_(scale)  # [N, H, ctx]
    beyond = torch.arange(ctx_len, device=q.device)[None, :] >= seq_lens[:, None]  # [N, ctx]
    scores.masked_fill_(beyond[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, rows[:, :, :kv_lora_rank])  # [N, H, R]


def mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The batch's decodes (its first ``metadata.num_decodes`` sequences, one token each)
    attending on their cached latents: ``q`` [num_decodes, H, R + P] absorbed queries ->
    [num_decodes, H, R] latent outputs (module docstring). Reads the cache only; the
    decodes' own rows must be stored already."""
    num_decodes, _, width = q.shape
    if width != latent_width(latent_cache) or not 0 < kv_lora_rank < width:
        raise ValueError(
            f"mla_decode_attention: query width {width}, cache row {latent_cache.shape[2]}, "
            f"kv_lora_rank {kv_lora_rank}"
        )
    if num_decodes != metadata.num_decodes:
        raise ValueError(f"{num_decodes} queries for {metadata.num_decodes} decodes")
    token_bytes = width * q.element_size()
    groups = metadata.decode_groups(
        _GROUP_COST_BYTES // token_bytes, _GROUP_MAX_BYTES // token_bytes
    )
    tables, seq_lens = metadata.block_tables[:num_decodes], metadata.seq_lens[:num_decodes]
    if groups[0].rows is None:  # one group: the whole batch, in order
        return _padded_decode(
            q, latent_cache, tables, seq_lens, groups[0].max_seq_len, scale, kv_lora_rank
        )
    out = q.new_empty(num_decodes, q.shape[1], kv_lora_rank)
    for group in groups:
        rows = group.rows
        out.index_copy_(
            0,
            rows,
            _padded_decode(
                q.index_select(0, rows),
                latent_cache,
                tables.index_select(0, rows),
                seq_lens.index_select(0, rows),
                group.max_seq_len,
                scale,
                kv_lora_rank,
            ),
        )
    return out


def mla_prefill_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The batch's extends (the sequences after its ``num_decodes`` decodes: prefill chunks,
    a cached prefix visible) attending causally on their cached latents in the absorbed
    form: ``q`` [num_extend_tokens, H, R + P], the extends' queries in batch order ->
    [num_extend_tokens, H, R]. Query ``i`` of a chunk of ``q_len`` in a context of
    ``seq_len`` sits at position ``seq_len - q_len + i`` and sees the rows up to it
    (bottom-right aligned). Reads the cache only; the chunks' own rows must be stored."""
    width = q.shape[2]
    if width != latent_width(latent_cache) or not 0 < kv_lora_rank < width:
        raise ValueError(
            f"mla_prefill_attention: query width {width}, cache row {latent_cache.shape[2]}, "
            f"kv_lora_rank {kv_lora_rank}"
        )
    query_lens = metadata.query_lens_cpu[metadata.num_decodes :]
    if q.shape[0] != sum(query_lens):
        raise ValueError(f"{q.shape[0]} queries for {sum(query_lens)} extend tokens")
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    start = 0
    for seq_idx in range(metadata.num_decodes, metadata.num_seqs):
        query_len, seq_len = metadata.query_lens_cpu[seq_idx], metadata.seq_lens_cpu[seq_idx]
        rows = gather_latent(latent_cache, metadata.block_tables[seq_idx], seq_len, q.dtype)
        chunk = q[start : start + query_len].transpose(0, 1)  # [H, q, R + P]
        scores = torch.matmul(chunk, rows.T).mul_(scale)  # [H, q, S]
        ctx = torch.arange(seq_len, device=q.device)
        beyond = ctx[None, :] > ctx[seq_len - query_len :, None]  # [q, S]: causal
        probs = torch.softmax(scores.masked_fill_(beyond, float("-inf")), dim=-1)
        out[start : start + query_len] = torch.matmul(probs, rows[:, :kv_lora_rank]).transpose(0, 1)
        start += query_len
    return out
