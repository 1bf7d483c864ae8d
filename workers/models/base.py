"""The interface the engine's model runner calls on every model."""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.attention_metadata import AttentionMetadata


class CausalLM(Protocol):
    """A decoder-only language model over the paged KV cache.

    Called by the model runner (prefill and decode workers alike) under
    ``torch.inference_mode()``.
    """

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Run one flat batch: ``input_ids``, ``positions`` [T] int64 -> hidden [T, hidden_size].

        Writes the batch's K/V into ``kv_cache`` [num_blocks, num_layers, 2, num_kv_heads,
        block_size, head_dim] at ``attn_metadata.slot_mapping``; reads the rest. In a
        pipeline, ``kv_cache`` holds the stage's layers only, and every stage but the last
        hands its activations to the next one and returns None.
        """
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32 (N: the rows to sample from); the last
        pipeline stage only."""
        ...
