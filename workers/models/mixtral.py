"""Mixtral, after Hugging Face's ``modeling_mixtral.py``: Mistral's attention with a sparse
MoE block in every layer (``workers/models/moe.py``): ``num_local_experts`` experts of
``intermediate_size``, top-``num_experts_per_tok`` routing, always renormalised (router
jitter is a training-time noise, off here). Checkpoints name the block
``block_sparse_moe`` and an expert's gate / up / down ``w1`` / ``w3`` / ``w2``. A
``sliding_window`` is treated as Mistral's: requests are limited to it
(``workers/engine/cache_sizing.py``), within which full attention is the same."""

from __future__ import annotations

from workers.models.moe import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    expert_layout = ("block_sparse_moe", "w1", "w3", "w2")
