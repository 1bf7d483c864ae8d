"""The one AttentionMetadata builder (the model runner, the tests and bench/gpu_kernels.py
use it): exact slots, padded tables, cu_seqlens_q and host copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention_metadata import build_attention_metadata, slot_mapping_for

BLOCK_SIZE = 4


def test_slots_are_block_id_times_block_size_plus_offset():
    # A decode at position 5 (block 1 of [7, 2]), then an extend of positions 2..5 over
    # blocks [3, 9]: its tokens straddle the block boundary.
    slots = slot_mapping_for([1, 4], [6, 6], [[7, 2], [3, 9]], BLOCK_SIZE)
    assert slots == [2 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1]


def test_ragged_tables_are_right_padded_and_lengths_kept_on_the_host():
    tables = [[7, 2], [3], [5, 6, 8]]
    query_lens, seq_lens = [1, 3, 2], [6, 3, 10]
    slots = slot_mapping_for(query_lens, seq_lens, tables, BLOCK_SIZE)
    md = build_attention_metadata(query_lens, seq_lens, tables, slots, num_decodes=1)
    assert md.block_tables.dtype == torch.int32
    assert md.block_tables.tolist() == [[7, 2, 0], [3, 0, 0], [5, 6, 8]]
    assert md.slot_mapping.dtype == torch.int64 and md.slot_mapping.tolist() == slots
    assert md.seq_lens.dtype == torch.int32 and md.seq_lens.tolist() == seq_lens
    assert md.query_start_loc.dtype == torch.int32
    assert md.query_start_loc.tolist() == [0, 1, 4, 6]
    assert (md.num_decodes, md.max_query_len, md.max_seq_len) == (1, 3, 10)
    assert md.seq_lens_cpu == (6, 3, 10) and md.query_lens_cpu == (1, 3, 2)
    assert md.num_seqs == 3


def test_the_runner_s_numpy_arrays_give_the_same_metadata_as_lists():
    tables = [[7, 2], [3, 9]]
    slots = slot_mapping_for([1, 4], [6, 6], tables, BLOCK_SIZE)
    from_lists = build_attention_metadata([1, 4], [6, 6], tables, slots, 1)
    from_arrays = build_attention_metadata(
        (1, 4), (6, 6), np.array(tables, dtype=np.int32), np.array(slots, dtype=np.int64), 1
    )
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        a, b = getattr(from_lists, name), getattr(from_arrays, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (from_lists.seq_lens_cpu, from_lists.query_lens_cpu) == (
        from_arrays.seq_lens_cpu,
        from_arrays.query_lens_cpu,
    )


def test_a_decode_with_more_than_one_query_token_is_refused():
    with pytest.raises(ValueError, match="first 2 sequences are decodes"):
        build_attention_metadata([1, 2], [5, 5], [[0, 1], [2, 3]], [0] * 3, num_decodes=2)
