"""The engine's speculative decoding: who speculates each step, and the verification.

Per step (docs/engine.md, "Speculative decoding"):

1. ``propose`` (before scheduling): each running decode that may speculate gets its
   proposals in ``req.spec_token_ids`` (n-gram: the tokens themselves; draft: k
   placeholders, filled in step 3). Nobody speculates when more than
   ``speculative_max_batch_size`` decodes run (a large batch is compute-bound already,
   and verifying k extra tokens per request would cost more than it saves); below it,
   a request speculates while its measured acceptance pays at this batch size (``gate.py``).
2. The scheduler turns such a request into a verify chunk (its last token + proposals)
   if budget and free blocks allow, else it decodes plainly.
3. ``before_prepare``: the draft model proposes for the batch's verify chunks.
4. After the target's forward, ``verify`` accepts a prefix of each proposal
   (``rejection.py``) and the engine appends the tokens and rolls the rest back
   (``Scheduler.update_verified``, ``rolled_back``).

Structured outputs: every verify row is masked by the request's grammar at its position
(``workers/engine/grammar.py``), so a proposal the grammar refuses is never accepted; an
n-gram proposal is cut to the prefix the grammar accepts before it is scheduled, and a
draft model proposes under the same masks.

A request speculates unless it opted out (``SamplingParams.speculative``), is a prefill
worker's request (it samples one token), or has room for fewer than two more tokens; and,
with the measured decisions on (``adaptive``, the default), while its own acceptance pays
for the extra cost of a verify step at this batch size (``gate.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.config import EngineConfig
from workers.engine.request import Request
from workers.engine.sampler import Sampler, SamplerOutput, SamplingRow
from workers.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from workers.engine.speculative.draft import DraftProposer, rolled_back
from workers.engine.speculative.gate import AcceptanceGate, StepMode
from workers.engine.speculative.ngram import NgramProposer
from workers.engine.speculative.rejection import RejectionSampler, Verified
from workers.engine.speculative.stats import SpecDecodeStats


def check_single_rank(
    config: EngineConfig, tp_size: int, pp_size: int, batches_in_flight: int | None
) -> None:
    """Refuse speculation on a multi-rank replica or with several batches in flight: the
    draft model and the verify step's rollback live on the one rank that samples."""
    if config.speculative_method is not None and (
        tp_size > 1 or pp_size > 1 or (batches_in_flight or 1) > 1
    ):
        raise ValueError(
            f"speculative_method: {config.speculative_method} is not supported on a "
            f"tensor/pipeline-parallel replica (tp={tp_size}, pp={pp_size}, "
            f"batches_in_flight={batches_in_flight}); unset it or use a single-rank replica"
        )


class SpeculativeDecoder:
    def __init__(
        self,
        config: EngineConfig,
        sampler: Sampler,
        draft: DraftProposer | None = None,
    ) -> None:
        if config.speculative_method is None:
            raise ValueError("speculative_method is unset")
        if (config.speculative_method == "draft") != (draft is not None):
            raise ValueError("a draft model goes with speculative_method: draft only")
        self.k = config.speculative_num_tokens
        self.max_batch_size = config.speculative_max_batch_size
        self.sampler = sampler
        self.ngram = (
            NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
            if draft is None
            else None
        )
        self.draft = draft
        self.rejection = RejectionSampler(sampler)
        self.stats = SpecDecodeStats()
        # Measured decisions (gate.py). False: speculate at every step a proposer may
        # (tests, the benchmark's "forced").
        self.gate = AcceptanceGate()
        self.adaptive = True
        self._draft_probs: dict[str, torch.Tensor | None] = {}

    def propose(self, scheduler: Scheduler, max_model_len: int) -> None:
        """Set every running request's proposals for the step about to be scheduled."""
        decodes = [r for r in scheduler.running if r.num_unscheduled_tokens == 1]
        mode = StepMode.EVERYONE
        if self.adaptive and 0 < len(decodes) <= self.max_batch_size:
            mode = self.gate.step_mode(len(decodes))
        speculate = 0 < len(decodes) <= self.max_batch_size and mode != StepMode.NOBODY
        self.gate.forget_all_but(set(scheduler.requests))
        for req in scheduler.running:
            req.spec_token_ids = []
        if not speculate:
            return
        for req in decodes:
            if not req.params.speculative or req.is_prefill_only:
                continue
            # Room for the proposals and the target's own token after them.
            room = min(req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens)
            k = min(self.k, room - 1)
            if k < 1 or (
                mode == StepMode.GATED and not self.gate.allows(req.request_id, len(decodes))
            ):
                continue
            if self.ngram is not None:
                proposals = self.ngram.propose(req.token_ids, k)
                if req.grammar is not None:
                    # Only the prefix the grammar accepts could be accepted in verification.
                    proposals = proposals[: req.grammar.num_valid(proposals)]
                req.spec_token_ids = proposals
            else:
                req.spec_token_ids = [0] * k  # the draft fills them in (before_prepare)

    def before_prepare(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        if self.draft is not None:
            self._draft_probs = self.draft.propose(sched, requests, self.sampler)

    def sample(
        self, live: Sequence[tuple[ScheduledChunk, Request]], logits: torch.Tensor
    ) -> tuple[SamplerOutput, list[Verified]]:
        """A batch's rows: plain chunks' through the sampler, verify chunks' through
        ``verify``; ``logits`` has ``chunk.num_sample_rows`` rows per live chunk."""
        plain = [r for c, r in live if c.needs_sample and not c.num_spec]
        verify = [(c, r) for c, r in live if c.num_spec]
        if not verify:
            return self.sampler(logits, [SamplingRow.of(r) for r in plain]), []
        plain_rows: list[int] = []
        verify_rows: list[int] = []
        row = 0
        for c, _ in live:
            (verify_rows if c.num_spec else plain_rows).extend(range(row, row + c.num_sample_rows))
            row += c.num_sample_rows
        sampled = SamplerOutput([], [])
        if plain:
            rows = [SamplingRow.of(r) for r in plain]
            sampled = self.sampler(logits[torch.tensor(plain_rows)], rows)
        return sampled, self.verify(logits[torch.tensor(verify_rows)], verify)

    def verify(
        self, logits: torch.Tensor, chunks: Sequence[tuple[ScheduledChunk, Request]]
    ) -> list[Verified]:
        """Verify the proposals of ``chunks`` (verify chunks, their rows of ``logits`` in
        order) and count them; the caller appends the tokens (``after_verify`` then)."""
        requests = [r for _, r in chunks]
        proposals = [r.spec_token_ids[: c.num_spec] for c, r in chunks]
        q = [self._draft_probs.pop(r.request_id, None) for r in requests]
        results = self.rejection(logits, requests, proposals, q)
        for (c, r), res in zip(chunks, results, strict=True):
            self.stats = self.stats.plus(c.num_spec, res.num_accepted)
            self.gate.record(r.request_id, res.num_accepted)
        return results

    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """A whole engine step ran ``sched`` in ``seconds``: decode-only steps feed the
        gate's step costs (a prefill chunk would blur them)."""
        if any(c.num_tokens > 1 and not c.num_spec for c in sched.chunks):
            return
        num_verified = sum(1 for c in sched.chunks if c.num_spec)
        if self.draft is not None:
            # Catching a request up after it sat out is paid once per stretch of speculation;
            # counted in a step's cost, it made speculation look slow exactly when it was
            # tried again, so it stayed off.
            seconds -= self.draft.catch_up_seconds
        self.gate.observe(len(sched.chunks), num_verified, seconds)

    def cancelled(self, requests: Sequence[Request]) -> None:
        """A batch failed: its proposals were not verified; the draft's KV of them (written
        before the target's forward) must not count as computed."""
        for req in requests:
            req.spec_token_ids = []
            req.draft_num_computed = min(req.draft_num_computed, req.num_computed_tokens)

    def after_verify(self, req: Request, chunk: ScheduledChunk, num_accepted: int) -> None:
        """The request's tokens are appended: roll the draft's KV back past them."""
        if self.draft is not None:
            rolled_back(req, chunk, num_accepted)
