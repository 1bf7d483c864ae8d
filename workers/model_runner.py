"""Turns a scheduled step into one flat, unpadded forward pass and returns logits.

Input preparation: the step's chunks (decodes first) become one run of token ids
with their positions, the KV slot of every new token (``slot_mapping``), padded
block tables, context lengths and ``cu_seqlens_q``. Logits are computed only for
the last token of chunks that sample (a prefill chunk that does not reach the
end of its prompt produces none). No policy decisions here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from workers.kv_cache import copy_blocks
from workers.models.base import CausalLM
from workers.request import Request
from workers.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, device: torch.device
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.last_prepare_s = 0.0  # input preparation time of the last step (engine stats)

    def prepare(
        self, sched: SchedulerOutput, requests: Mapping[str, Request]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build (input_ids, positions, metadata, sample_indices) for the step."""
        bs = self.block_size
        chunks = sched.chunks
        num_seqs = len(chunks)
        num_tokens = sched.num_batched_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slot_mapping = np.empty(num_tokens, dtype=np.int64)
        max_blocks = max(len(c.block_ids) for c in chunks)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        seq_lens: list[int] = []
        query_lens: list[int] = []
        query_start_loc = [0]
        sample_indices: list[int] = []
        num_decodes = 0
        offset = 0
        for i, chunk in enumerate(chunks):
            start, n = chunk.start_pos, chunk.num_tokens
            end = start + n
            req = requests[chunk.request_id]
            table = np.asarray(chunk.block_ids, dtype=np.int64)
            block_tables[i, : len(table)] = table
            if n == 1:
                num_decodes += 1
                input_ids[offset] = req.token_ids[start]
                positions[offset] = start
                slot_mapping[offset] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, end, dtype=np.int64)
                input_ids[offset : offset + n] = req.token_ids[start:end]
                positions[offset : offset + n] = pos
                slot_mapping[offset : offset + n] = table[pos // bs] * bs + pos % bs
            offset += n
            seq_lens.append(end)
            query_lens.append(n)
            query_start_loc.append(offset)
            if chunk.needs_sample:
                sample_indices.append(offset - 1)

        def to_dev(array: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.as_tensor(array, dtype=dtype)
            return (
                tensor.to(self.device, non_blocking=True) if self.device.type != "cpu" else tensor
            )

        metadata = AttentionMetadata(
            slot_mapping=to_dev(slot_mapping, torch.int64),
            block_tables=to_dev(block_tables, torch.int32),
            seq_lens=to_dev(seq_lens, torch.int32),
            query_start_loc=to_dev(query_start_loc, torch.int32),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            seq_lens_cpu=tuple(seq_lens),
            query_lens_cpu=tuple(query_lens),
        )
        return (
            to_dev(input_ids, torch.int64),
            to_dev(positions, torch.int64),
            metadata,
            to_dev(sample_indices, torch.int64),
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> torch.Tensor:
        """Run the step; returns float32 logits [num_sampling_chunks, vocab] (possibly 0 rows)."""
        t0 = time.perf_counter()
        copy_blocks(self.kv_cache, sched.block_copies)
        input_ids, positions, metadata, sample_indices = self.prepare(sched, requests)
        self.last_prepare_s = time.perf_counter() - t0
        hidden = self.model.forward(input_ids, positions, self.kv_cache, metadata)
        return self.model.compute_logits(hidden[sample_indices])
