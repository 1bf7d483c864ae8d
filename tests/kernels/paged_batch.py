"""Test helpers: lay sequences out in a paged KV cache and describe them with AttentionMetadata.

Shared by the kernel tests and the model tests (tests/workers/test_models.py).
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import (
    AttentionMetadata,
    build_attention_metadata,
    slot_mapping_for,
)


def random_block_tables(
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    generator: torch.Generator,
    shared_prefix_lens: list[int] | None = None,
) -> list[list[int]]:
    """Give each sequence enough distinct, randomly ordered (non-contiguous) block ids.

    ``shared_prefix_lens[i] = n`` makes sequence i reuse sequence 0's first
    ``n // block_size`` blocks (a prefix-cache hit): only full blocks are shared.
    """
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables: list[list[int]] = []
    for i, seq_len in enumerate(seq_lens):
        num_needed = -(-seq_len // block_size)
        num_shared = 0
        if shared_prefix_lens is not None and i > 0:
            num_shared = min(shared_prefix_lens[i] // block_size, len(tables[0]))
        table = tables[0][:num_shared] if num_shared else []
        fresh = num_needed - num_shared
        if fresh > len(perm):
            raise ValueError("not enough blocks for the test batch")
        table += perm[:fresh]
        del perm[:fresh]
        tables.append(table)
    return tables


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for a flat batch: sequence i's new tokens sit at positions
    ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``; the first ``num_decodes`` are decodes.
    The engine's own builder, with the slots computed from the block tables."""
    slots = slot_mapping_for(query_lens, seq_lens, block_tables, block_size)
    return build_attention_metadata(query_lens, seq_lens, block_tables, slots, num_decodes, device)


def positions_for(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """[num_tokens] int64 positions of the new tokens of a flat batch."""
    return torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    ).to(torch.int64)
