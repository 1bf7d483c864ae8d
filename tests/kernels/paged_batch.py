"""Test helpers: lay sequences out in a paged KV cache and describe them with AttentionMetadata.

Shared by the kernel tests and the model tests (tests/workers/test_models.py).
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata


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
    ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``; the first ``num_decodes`` are decodes."""
    assert all(q == 1 for q in query_lens[:num_decodes])
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_num_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_num_blocks - len(t)) for t in block_tables]
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_cpu=tuple(seq_lens),
        query_lens_cpu=tuple(query_lens),
    )


def positions_for(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """[num_tokens] int64 positions of the new tokens of a flat batch."""
    return torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    ).to(torch.int64)
