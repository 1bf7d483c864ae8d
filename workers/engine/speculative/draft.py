"""Draft-model proposals: a small model with the target's tokenizer guesses k tokens.

The draft shares the target's paged cache *accounting*: its own KV tensor has the same
number of blocks, indexed by the target's block ids and tables, so every block a request
owns holds the target's KV in one tensor and the draft's in the other; no second
allocator, and freeing, preemption and prefix caching need nothing extra. (Cache sizing
counts both tensors' bytes per block.)

The draft's KV is filled lazily: ``req.draft_num_computed`` says how many leading
positions hold it. Proposing for a verify chunk (the request's last token at position
``n - 1`` and k proposals after it) runs k draft forwards, batched over the step's
speculating requests: the first computes the positions the draft has not seen yet
(``draft_num_computed .. n - 1``: usually one or two tokens; the whole prompt the first
time, after a preemption, or on a decode worker whose prompt KV came from a prefill
worker: the draft's KV is never transferred) and the others one token each. They write
positions up to ``n + k - 2``, inside the blocks the scheduler gave the verify chunk.
After verification only positions holding accepted tokens stay valid (``rolled_back``).

The forwards: a plain Llama-family draft runs them through a lean forward of one token per
row (``draft_loop.py``, ``draft_forward.py``: a small model's step through the general
runner is per-op overhead); a request more than ``MAX_LEAN_CATCH_UP`` positions behind first
gets the rest through the model runner in one prefill-like forward. Other architectures
take the runner for every forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from kernels.cpu_linear import packing_supported
from workers.engine.kv_cache import allocate_kv_cache, bytes_per_block, copy_blocks
from workers.engine.model_runner import ModelRunner
from workers.engine.request import Request
from workers.engine.sampler import Sampler
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.engine.speculative.draft_forward import LeanDraftForward
from workers.engine.speculative.draft_loop import (
    MAX_LEAN_CATCH_UP,
    choose_proposals,
    propose_lean,
)
from workers.models.fused_decode import attach_fused_decode
from workers.models.layers import pack_linear_weights
from workers.models.loader import load_model


class DraftProposer:
    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        device: torch.device,
        target_vocab_size: int,
        max_model_len: int,
    ) -> None:
        """Loads the draft. Raises ValueError (naming speculative_draft_model) when its
        vocabulary differs from the target's or it is shorter than max_model_len."""
        # Unpacked first: the lean forward multiplies with F.linear (draft_forward.py).
        self.model, self.arch = load_model(model_dir, dtype=dtype, device=device, pack_linear=False)
        self.lean_supported = LeanDraftForward.supports(self.model)
        if not self.lean_supported and device.type == "cpu" and packing_supported(dtype):
            pack_linear_weights(self.model)  # what load_model would have done
            attach_fused_decode(self.model)  # again: its stack held the unpacked weights
        if self.arch.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_draft_model: vocabulary of {self.arch.vocab_size} tokens, the "
                f"target has {target_vocab_size}; the draft must share the target's tokenizer"
            )
        if self.arch.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_draft_model: max_position_embeddings="
                f"{self.arch.max_position_embeddings} is below max_model_len={max_model_len}"
            )
        self.dtype = dtype
        self.device = device
        self.runner: ModelRunner | None = None
        self.lean: LeanDraftForward | None = None
        # Seconds (by ``clock``, the engine's speculation clock) the last ``propose`` spent
        # catching requests up that were far behind: the price of (re)starting speculation
        # for a request, not of a speculating step; the gate leaves it out of its step costs.
        self.clock: Callable[[], float] = time.perf_counter
        self.catch_up_seconds = 0.0

    def bytes_per_block(self, block_size: int) -> int:
        a = self.arch
        return bytes_per_block(
            a.num_hidden_layers, a.num_key_value_heads, block_size, a.head_dim, self.dtype
        )

    def bind(self, num_blocks: int, block_size: int) -> None:
        """Allocate the draft's KV tensor: the target's block count and size."""
        a = self.arch
        kv_cache = allocate_kv_cache(
            num_blocks, a.num_hidden_layers, a.num_key_value_heads, block_size, a.head_dim,
            self.dtype, self.device,
        )  # fmt: skip
        self.runner = ModelRunner(self.model, kv_cache, block_size, self.device)
        if self.lean_supported:
            self.lean = LeanDraftForward(self.model, kv_cache, block_size)

    @torch.inference_mode()
    def propose(
        self, sched: SchedulerOutput, requests: Mapping[str, Request], sampler: Sampler
    ) -> dict[str, torch.Tensor | None]:
        """Fill in the proposals (``req.spec_token_ids``) of ``sched``'s verify chunks;
        returns per request the distributions [k, V] they were drawn from (None for
        greedy requests: their proposals are the draft's argmax)."""
        assert self.runner is not None, "bind() first"
        copy_blocks(self.runner.kv_cache, sched.block_copies)  # the target's copy-on-write
        self.catch_up_seconds = 0.0
        verify = [(c, requests[c.request_id]) for c in sched.chunks if c.num_spec]
        if not verify:
            return {}
        if self.lean is None:
            return self._propose_general(verify, requests, sampler)
        # Far behind (a new prompt, after a preemption, a handed-off request): the general
        # path computes all but the last known token in one forward, as a prefill.
        behind = [
            ScheduledChunk(r.request_id, r.draft_num_computed, r.num_tokens - 1 - r.draft_num_computed,
                           c.block_ids, needs_sample=False)
            for c, r in verify if r.num_tokens - r.draft_num_computed > MAX_LEAN_CATCH_UP
        ]  # fmt: skip
        if behind:
            start = self.clock()
            behind.sort(key=lambda chunk: chunk.num_tokens != 1)  # decodes first
            self.runner.run(
                self.runner.prepare_inputs(SchedulerOutput(tuple(behind), (), ()), requests)
            )
            for chunk in behind:
                requests[chunk.request_id].draft_num_computed = chunk.start_pos + chunk.num_tokens
            self.catch_up_seconds = self.clock() - start
        return propose_lean(self.lean, verify, sampler)

    def _propose_general(
        self,
        verify: list[tuple[ScheduledChunk, Request]],
        requests: Mapping[str, Request],
        sampler: Sampler,
    ) -> dict[str, torch.Tensor | None]:
        """k forwards through the model runner (a draft the lean forward does not take)."""
        assert self.runner is not None
        # The first forward catches up; decodes (one token) first, as the runner expects.
        first = [
            (ScheduledChunk(r.request_id, r.draft_num_computed, r.num_tokens - r.draft_num_computed,
                            c.block_ids, needs_sample=True), c, r)
            for c, r in verify
        ]  # fmt: skip
        first.sort(key=lambda t: t[0].num_tokens != 1)
        order = [(c, r) for _, c, r in first]
        chunks = [d for d, _, _ in first]
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for _, r in order}
        for j in range(max(c.num_spec for c, _ in order)):
            if j > 0:
                order = [(c, r) for c, r in order if c.num_spec > j]
                chunks = [
                    ScheduledChunk(r.request_id, r.num_tokens + j - 1, 1, c.block_ids, True)
                    for c, r in order
                ]
            inputs = self.runner.prepare_inputs(SchedulerOutput(tuple(chunks), (), ()), requests)
            logits = self.runner.run(inputs)
            assert logits is not None
            ids = choose_proposals(logits, [r for _, r in order], j, sampler, probs).tolist()
            for (_, r), token in zip(order, ids, strict=True):
                r.spec_token_ids[j] = token
        for c, r in verify:
            # Positions n - 1 .. n + k - 2 now hold the draft's KV (of proposals, so far).
            r.draft_num_computed = c.start_pos + c.num_spec
        return {
            r.request_id: torch.stack(probs[r.request_id]) if probs[r.request_id] else None
            for _, r in verify
        }


def rolled_back(req: Request, chunk: ScheduledChunk, num_accepted: int) -> None:
    """After verification: the draft's KV stays valid up to the last accepted proposal."""
    last_pos = chunk.start_pos  # the verified chunk's first position: the last token
    req.draft_num_computed = min(req.draft_num_computed, last_pos + 1 + num_accepted)
