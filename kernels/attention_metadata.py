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

from dataclasses import dataclass, field
from itertools import pairwise

import torch


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, for an op that pads a group to its longest."""

    rows: torch.Tensor | None  # indexes into the batch's decodes; None: all, in order
    num_rows: int
    max_seq_len: int


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
    # decode_groups, memoized: every layer of the step asks the same.
    _groups: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def decode_groups(self, group_cost: int, max_group: int) -> tuple[DecodeGroup, ...]:
        """The decodes split into groups of similar context length, longest first.

        Costs are in row-tokens (a row padded to a length of ``L`` costs ``L``):
        ``group_cost`` is what one more group costs; a group's rows times its longest
        context stay within ``max_group`` unless it is one row. Walking the rows from the
        longest context down, a new group starts where padding the rest to the current
        group's longest would cost more than a group does, or where the group would
        grow past ``max_group``.
        """
        key = (group_cost, max_group)
        if key not in self._groups:
            self._groups[key] = self._split_decodes(group_cost, max_group)
        return self._groups[key]

    def _split_decodes(self, group_cost: int, max_group: int) -> tuple[DecodeGroup, ...]:
        lens = self.seq_lens_cpu[: self.num_decodes]
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        bounds = [0]
        for i in range(1, len(order)):
            longest = lens[order[bounds[-1]]]
            padding = (longest - lens[order[i]]) * (len(order) - i)
            if padding >= group_cost or (i - bounds[-1] + 1) * longest > max_group:
                bounds.append(i)
        if len(bounds) == 1:
            return (DecodeGroup(None, len(lens), max(lens, default=0)),)
        bounds.append(len(order))
        device = self.seq_lens.device
        return tuple(
            DecodeGroup(
                torch.tensor(order[start:end], dtype=torch.long, device=device),
                end - start,
                lens[order[start]],
            )
            for start, end in pairwise(bounds)
        )
