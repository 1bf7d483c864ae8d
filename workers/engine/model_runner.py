"""Turns a scheduled step into one flat, unpadded forward pass and returns logits.

Input preparation: the step's chunks (decodes first) become one run of token ids
with their positions, the KV slot of every new token (``slot_mapping``), padded
block tables, context lengths and ``cu_seqlens_q`` (a :class:`StepInputs`). Logits are
computed only for the last token of chunks that sample (a prefill chunk that does not
reach the end of its prompt produces none), for every token of a speculative verify
chunk, and for the positions a chunk asks prompt logprobs of (``num_prompt_logprobs``;
their rows follow the sampled ones). No policy decisions here.

In a replica of several ranks, rank 0 hands each step's inputs to ``before_forward``
(which sends them to the other ranks) and every rank then runs ``run`` on the same
inputs: the collectives inside the model pair up, and so do the sends and receives
between pipeline stages. Only the last stage (rank 0's) returns logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata, as_device_tensor, build_attention_metadata
from workers.engine.decode_graphs import DecodeGraphs
from workers.engine.kv_cache import copy_blocks
from workers.engine.request import Request
from workers.engine.scheduler import SchedulerOutput
from workers.engine.step_inputs import StepInputs
from workers.models.base import CausalLM
from workers.models.expert_rebalance import ExpertRebalancer


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        device: torch.device,
        before_forward: Callable[[StepInputs], None] | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.before_forward = before_forward
        # Decode steps replayed from captured graphs (CUDA, one rank; set by the engine).
        self.graphs: DecodeGraphs | None = None
        # MoE expert placement swaps (expert_rebalance: on); set by the engine.
        self.rebalancer: ExpertRebalancer | None = None

    def prepare_inputs(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> StepInputs:
        """The step's flat batch as host arrays."""
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
        query_start_loc = [0]
        sample_indices: list[int] = []
        prompt_logprob_indices: list[int] = []
        num_decodes = 0
        offset = 0
        for i, chunk in enumerate(chunks):
            start, n = chunk.start_pos, chunk.num_tokens
            end = start + n
            req = requests[chunk.request_id]
            # Past the committed tokens: speculative proposals (verify or draft chunks).
            seq = req.token_ids if end <= req.num_tokens else req.token_ids + req.spec_token_ids
            table = np.asarray(chunk.block_ids, dtype=np.int64)
            block_tables[i, : len(table)] = table
            if n == 1:
                num_decodes += 1
                input_ids[offset] = seq[start]
                positions[offset] = start
                slot_mapping[offset] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, end, dtype=np.int64)
                input_ids[offset : offset + n] = seq[start:end]
                positions[offset : offset + n] = pos
                slot_mapping[offset : offset + n] = table[pos // bs] * bs + pos % bs
            if chunk.num_prompt_logprobs:
                prompt_logprob_indices.extend(range(offset, offset + chunk.num_prompt_logprobs))
            offset += n
            seq_lens.append(end)
            query_start_loc.append(offset)
            if chunk.needs_sample:
                sample_indices.extend(range(offset - 1 - chunk.num_spec, offset))
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=tuple(seq_lens),
            query_start_loc=tuple(query_start_loc),
            num_decodes=num_decodes,
            sample_indices=tuple(sample_indices),
            block_copies=tuple(sched.block_copies),
            prompt_logprob_indices=tuple(prompt_logprob_indices),
            # Rank 0 decides; the flag travels with the step so every rank starts alike.
            expert_rebalance=self.rebalancer is not None and self.rebalancer.due(),
        )

    def to_device(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, metadata, logits_indices) as tensors on the device."""
        metadata = build_attention_metadata(
            inputs.query_lens,
            inputs.seq_lens,
            inputs.block_tables,
            inputs.slot_mapping,
            inputs.num_decodes,
            self.device,
        )
        return (
            as_device_tensor(inputs.input_ids, torch.int64, self.device),
            as_device_tensor(inputs.positions, torch.int64, self.device),
            metadata,
            as_device_tensor(inputs.logits_indices, torch.int64, self.device),
        )

    def launch(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> StepInputs:
        """Prepare the step's inputs and send them to the other ranks (``before_forward``);
        ``run`` computes them, now or, with pipeline stages, once earlier batches are done."""
        inputs = self.prepare_inputs(sched, requests)
        if self.before_forward is not None:
            self.before_forward(inputs)
        return inputs

    @torch.inference_mode()
    def run(
        self, inputs: StepInputs, layer_hook: Callable[[int], None] | None = None
    ) -> torch.Tensor | None:
        """The forward pass of prepared inputs (every rank of a replica runs this): logits
        of ``inputs.logits_indices`` (sampled rows, then prompt-logprob rows); None on a
        pipeline stage before the last, whose activations went to the next stage.
        ``layer_hook(i)`` runs after the stage's ``i``-th layer, once its KV is stored (a
        layer-wise hand-off: ``workers/engine/layerwise.py``)."""
        copy_blocks(self.kv_cache, inputs.block_copies)
        if self.rebalancer is not None:  # between forwards: no forward reads a moving slot
            self.rebalancer.on_step(inputs.expert_rebalance)
        graphs = self.graphs
        if layer_hook is None and graphs is not None and graphs.takes(inputs):
            return graphs.run(inputs)
        input_ids, positions, metadata, logits_indices = self.to_device(inputs)
        hooks = self._attach(layer_hook) if layer_hook is not None else ()
        try:
            hidden = self.model.forward(input_ids, positions, self.kv_cache, metadata)
        finally:
            for handle in hooks:
                handle.remove()
        if hidden is None:
            return None
        return self.model.compute_logits(hidden[logits_indices])

    def _attach(self, layer_hook: Callable[[int], None]) -> list:
        """Forward hooks on the stage's decoder layers for one step (none otherwise, so an
        ordinary step pays nothing). On CUDA the hook waits for the layer's kernels: a
        transfer must not read the KV before it is written."""
        inner = self.model.model
        layers = inner.layers[inner.start_layer : inner.end_layer]
        is_cuda = self.device.type == "cuda"

        def hook(index: int) -> None:
            if is_cuda:
                torch.cuda.current_stream(self.device).synchronize()
            layer_hook(index)

        return [
            layer.register_forward_hook(lambda *_args, i=i: hook(i))
            for i, layer in enumerate(layers)
        ]
