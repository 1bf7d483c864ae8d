"""One forward pass's inputs as plain host arrays, and their msgpack form.

The model runner builds :class:`StepInputs` from the scheduler's output; a
tensor-parallel replica's rank 0 sends them, typed, to the other ranks, which run the
same forward pass on their shards without a scheduler of their own
(``workers/parallel/replica_messages.py``). Everything the attention metadata needs derives
from these fields, so the ranks cannot disagree about it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepInputs:
    input_ids: np.ndarray  # [num_tokens] int64, the flat batch (decodes first)
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64: block_id * block_size + offset
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, right-padded with 0
    seq_lens: tuple[int, ...]  # context length of each sequence after this step
    query_start_loc: tuple[int, ...]  # [num_seqs + 1]: cu_seqlens_q
    num_decodes: int  # the first num_decodes sequences have one query token each
    sample_indices: tuple[int, ...]  # flat positions whose logits are sampled
    block_copies: tuple[tuple[int, int], ...] = ()  # (src, dst) copy-on-write, before the step

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> tuple[int, ...]:
        qsl = self.query_start_loc
        return tuple(qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1))

    def to_msg(self) -> list:
        table = self.block_tables
        return [
            self.input_ids.astype(np.int64, copy=False).tobytes(),
            self.positions.astype(np.int64, copy=False).tobytes(),
            self.slot_mapping.astype(np.int64, copy=False).tobytes(),
            table.astype(np.int32, copy=False).tobytes(),
            list(table.shape),
            list(self.seq_lens),
            list(self.query_start_loc),
            self.num_decodes,
            list(self.sample_indices),
            [list(pair) for pair in self.block_copies],
        ]

    @classmethod
    def from_msg(cls, msg: list) -> StepInputs:
        """Raises ValueError when the fields do not describe one consistent batch."""
        if not isinstance(msg, list) or len(msg) != 10:
            raise ValueError("step inputs: expected a list of 10 fields")
        ids, pos, slots, table, shape, seq_lens, qsl, num_decodes, samples, copies = msg

        def array(data: bytes, dtype) -> np.ndarray:
            # Writable (a copy): torch refuses to wrap read-only buffers without a warning.
            return np.frombuffer(bytearray(data), dtype=dtype)

        input_ids = array(ids, np.int64)
        num_tokens = input_ids.shape[0]
        num_seqs, max_blocks = shape
        inputs = cls(
            input_ids=input_ids,
            positions=array(pos, np.int64),
            slot_mapping=array(slots, np.int64),
            block_tables=array(table, np.int32).reshape(num_seqs, max_blocks),
            seq_lens=tuple(seq_lens),
            query_start_loc=tuple(qsl),
            num_decodes=int(num_decodes),
            sample_indices=tuple(samples),
            block_copies=tuple((int(s), int(d)) for s, d in copies),
        )
        if (
            inputs.positions.shape[0] != num_tokens
            or inputs.slot_mapping.shape[0] != num_tokens
            or len(inputs.seq_lens) != num_seqs
            or len(inputs.query_start_loc) != num_seqs + 1
            or inputs.query_start_loc[-1] != num_tokens
            or not 0 <= inputs.num_decodes <= num_seqs
        ):
            raise ValueError("step inputs: field lengths disagree")
        return inputs
