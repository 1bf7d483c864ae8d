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

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

import numpy as np
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


def as_device_tensor(
    values: np.ndarray | Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Host integers as a ``dtype`` tensor on ``device``. The copy to an accelerator is
    ``non_blocking``: it is ordered on the stream before the kernels that read it."""
    tensor = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    return tensor.to(device, non_blocking=True) if device.type != "cpu" else tensor


def slot_mapping_for(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> list[int]:
    """The slot of every new token of a flat batch: sequence i's new tokens sit at
    positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`` of its block table.
    (The model runner computes the same with numpy, as it lays out the step's tokens.)"""
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: np.ndarray | Sequence[Sequence[int]],
    slot_mapping: np.ndarray | Sequence[int],
    num_decodes: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """The :class:`AttentionMetadata` of a flat batch from its host-side description
    (the model runner each step; the kernel and model tests; bench/gpu_kernels.py).

    ``block_tables``: one row of block ids per sequence (ragged rows are right-padded
    with 0); ``slot_mapping``: one slot per new token (:func:`slot_mapping_for`); the first
    ``num_decodes`` sequences must have one query token each. Raises ValueError otherwise.
    """
    if any(q_len != 1 for q_len in query_lens[:num_decodes]):
        raise ValueError(f"the first {num_decodes} sequences are decodes: one query token each")
    if not isinstance(block_tables, np.ndarray):
        max_num_blocks = max(len(t) for t in block_tables)
        block_tables = [list(t) + [0] * (max_num_blocks - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=as_device_tensor(slot_mapping, torch.int64, device),
        block_tables=as_device_tensor(block_tables, torch.int32, device),
        seq_lens=as_device_tensor(seq_lens, torch.int32, device),
        query_start_loc=as_device_tensor(
            list(accumulate(query_lens, initial=0)), torch.int32, device
        ),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_cpu=tuple(seq_lens),
        query_lens_cpu=tuple(query_lens),
    )
