"""One forward pass's inputs as plain host arrays, and their wire form.

The model runner builds :class:`StepInputs` from the scheduler's output; a
tensor-parallel replica's rank 0 sends them, typed, to the other ranks, which run the
same forward pass on their shards without a scheduler of their own
(``workers/parallel/replica_messages.py``). Everything the attention metadata needs derives
from these fields, so the ranks cannot disagree about it.

On the wire a step is a :class:`StepMsg` (a msgspec struct, encoded as a positional
array): the arrays as their raw bytes, the rest as typed ints.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np


class StepMsg(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """:class:`StepInputs` on the wire (``to_msg`` / ``from_msg``)."""

    # The arrays' bytes, native order. bytearray, not bytes: decoded, they are the arrays'
    # writable buffers, copied once out of the message (torch wraps no read-only buffer).
    input_ids: bytearray  # int64
    positions: bytearray  # int64
    slot_mapping: bytearray  # int64
    block_tables: bytearray  # int32, [num_seqs, max_blocks] row-major
    table_shape: tuple[int, int]
    seq_lens: tuple[int, ...]
    query_start_loc: tuple[int, ...]
    num_decodes: int
    sample_indices: tuple[int, ...]
    block_copies: tuple[tuple[int, int], ...]
    prompt_logprob_indices: tuple[int, ...] = ()
    expert_rebalance: bool = False


@dataclass(frozen=True)
class StepInputs:
    """A dataclass of numpy arrays (built every step by the model runner); its wire form
    is a :class:`StepMsg`."""

    input_ids: np.ndarray  # [num_tokens] int64, the flat batch (decodes first)
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64: block_id * block_size + offset
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, right-padded with 0
    seq_lens: tuple[int, ...]  # context length of each sequence after this step
    query_start_loc: tuple[int, ...]  # [num_seqs + 1]: cu_seqlens_q
    num_decodes: int  # the first num_decodes sequences have one query token each
    sample_indices: tuple[int, ...]  # flat positions whose logits are sampled
    block_copies: tuple[tuple[int, int], ...] = ()  # (src, dst) copy-on-write, before the step
    # Flat positions whose logits score the next prompt token (prompt logprobs); their
    # rows follow the sampled ones. Empty unless a request asked for prompt_logprobs.
    prompt_logprob_indices: tuple[int, ...] = ()
    # MoE: this step starts an expert placement rebalance on every rank, before its forward
    # (workers/models/expert_rebalance.py).
    expert_rebalance: bool = False

    @property
    def logits_indices(self) -> tuple[int, ...]:
        """Every flat position whose logits are computed: sampled rows, then prompt rows."""
        if not self.prompt_logprob_indices:
            return self.sample_indices
        return self.sample_indices + self.prompt_logprob_indices

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> tuple[int, ...]:
        qsl = self.query_start_loc
        return tuple(qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1))

    def to_msg(self) -> StepMsg:
        table = self.block_tables
        return StepMsg(
            bytearray(self.input_ids.astype(np.int64, copy=False)),
            bytearray(self.positions.astype(np.int64, copy=False)),
            bytearray(self.slot_mapping.astype(np.int64, copy=False)),
            bytearray(table.astype(np.int32, copy=False)),
            (table.shape[0], table.shape[1]),
            self.seq_lens,
            self.query_start_loc,
            self.num_decodes,
            self.sample_indices,
            self.block_copies,
            self.prompt_logprob_indices,
            self.expert_rebalance,
        )

    @classmethod
    def from_msg(cls, msg: StepMsg) -> StepInputs:
        """Raises ValueError when the fields do not describe one consistent batch."""
        input_ids = np.frombuffer(msg.input_ids, dtype=np.int64)
        num_tokens = input_ids.shape[0]
        num_seqs, max_blocks = msg.table_shape
        inputs = cls(
            input_ids=input_ids,
            positions=np.frombuffer(msg.positions, dtype=np.int64),
            slot_mapping=np.frombuffer(msg.slot_mapping, dtype=np.int64),
            block_tables=np.frombuffer(msg.block_tables, dtype=np.int32).reshape(
                num_seqs, max_blocks
            ),
            seq_lens=msg.seq_lens,
            query_start_loc=msg.query_start_loc,
            num_decodes=msg.num_decodes,
            sample_indices=msg.sample_indices,
            block_copies=msg.block_copies,
            prompt_logprob_indices=msg.prompt_logprob_indices,
            expert_rebalance=msg.expert_rebalance,
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
