"""What one forward pass tells the attention ops about the flattened batch.

The batch is one flat run of tokens without padding. Sequences are ordered with
all *decodes* first (exactly one query token each), then the *extends* (prefill
chunks: one or more query tokens attending to a cached prefix plus themselves).

KV cache layout (the whole cache, one tensor per worker):

    kv_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]

Block-major across layers, so one block of one request is one contiguous region
(num_layers * 2 * num_kv_heads * block_size * head_dim elements): a request's KV
hands off to another worker as one descriptor per block, and runs of consecutive
block ids merge into one (see docs/kv-cache-layout.md). An attention layer works
on its view ``kv_cache[:, layer]``: [num_blocks, 2, num_kv_heads, block_size, head_dim],
index 0 of dim 1 is K, 1 is V.

A token's *slot* is ``block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; where each new token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, right-padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_seqlens_q over the flat batch
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_query_len: int
    max_seq_len: int
    # Host copies of the per-sequence lengths, so CPU-side loops never sync a device.
    seq_lens_cpu: tuple[int, ...]
    query_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
