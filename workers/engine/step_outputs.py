"""A request's new tokens into its stream: detokenize, check the stops, finish or hold.

One engine step appends one token per request, or several for a speculative verify step
(the accepted proposals and the target's own token): the stop conditions are checked
after each, and the tokens after one that ends the request are dropped. ``update`` is the
engine step's last stage (schedule -> execute -> sample -> update): the computed chunks
advance their requests in the scheduler and the sampled tokens go into the streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from workers.engine.handoff import KVHandoff
from workers.engine.outputs import StreamDelta
from workers.engine.request import Request, check_stop
from workers.engine.scheduler import Scheduler
from workers.protocol.logprobs import TokenLogprobs
from workers.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from workers.engine.sampler import SamplerOutput
    from workers.engine.scheduler import ScheduledChunk
    from workers.engine.speculative.decoder import SpeculativeDecoder
    from workers.engine.speculative.rejection import Verified


class StepOutputs:
    def __init__(
        self,
        scheduler: Scheduler,
        handoff: KVHandoff,
        detokenizers: dict[str, IncrementalDetokenizer],
        max_model_len: int,
    ) -> None:
        """``detokenizers``: the engine's, per request (shared, not copied; empty when the
        router detokenizes)."""
        self.scheduler = scheduler
        self.handoff = handoff
        self.detokenizers = detokenizers
        self.max_model_len = max_model_len

    def update(
        self,
        live: list[tuple[ScheduledChunk, Request]],
        sampled: SamplerOutput,
        verified: list[Verified],
        spec: SpeculativeDecoder | None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> list[StreamDelta]:
        """After a batch ran and was sampled: advance each chunk's request (the scheduler's
        ``update_computed`` / ``update_verified``) and append its sampled tokens
        (``after_tokens``); returns the deltas of the chunks that sampled. ``sampled``
        has one row per plain sampling chunk, in order; ``verified`` one result per
        verify chunk (``num_spec``), in order (``spec`` sampled them); ``prompt_logprobs``
        the prompt logprobs of the chunks that computed some, by request id."""
        deltas = []
        row = 0
        results = iter(verified)
        for chunk, req in live:
            if chunk.num_spec:
                res = next(results)
                # Append first (the committed tokens' blocks get hashed), then roll back,
                # unless a stop among them ended the request (its blocks are freed).
                delta = self.after_tokens(req, res.token_ids, res.logprobs)
                if not req.is_finished:
                    self.scheduler.update_verified(chunk, res.num_accepted)
                    spec.after_verify(req, chunk, res.num_accepted)  # type: ignore[union-attr]
                deltas.append(delta)
                continue
            if chunk.num_prompt_logprobs and prompt_logprobs:
                req.add_prompt_logprobs(chunk.start_pos, prompt_logprobs[req.request_id])
            req = self.scheduler.update_computed(chunk)
            if not chunk.needs_sample:
                continue
            token_id = sampled.token_ids[row]
            logprobs = sampled.logprobs[row]
            row += 1
            deltas.append(self.after_tokens(req, (token_id,), (logprobs,)))
        return deltas

    def after_tokens(
        self,
        req: Request,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
    ) -> StreamDelta:
        """Append a request's new tokens one by one, detokenizing and applying the stop
        conditions after each; tokens after one that ends the request are dropped."""
        detok = self.detokenizers.get(req.request_id)
        text, reason, stop_reason = "", None, None
        emitted: list[int] = []
        for token_id in token_ids:
            req.append_token(token_id)
            emitted.append(token_id)
            stop_matched = None
            if detok is not None:
                may_stop = req.num_output_tokens >= req.params.min_tokens
                step = detok.step([token_id], check_stop=may_stop)
                text, stop_matched = text + step.text, step.stop_matched
            reason, stop_reason = check_stop(req, token_id, stop_matched, self.max_model_len)
            if reason is not None:
                break
        new_ids = tuple(emitted)
        new_logprobs = None
        if logprobs[0] is not None:
            new_logprobs = tuple(lp for lp in logprobs[: len(emitted)] if lp is not None)
        prompt = req.take_prompt_logprobs()  # the first delta with tokens carries them
        if reason is None and req.is_prefill_only:
            return self.hold(req, new_ids[0], text, new_logprobs, prompt)
        if reason is None:
            return StreamDelta(
                req.request_id,
                new_ids,
                text,
                new_logprobs,
                finished=False,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                prompt_logprobs=prompt,
            )
        req.stop_reason = stop_reason
        self.scheduler.finish(req, reason)
        return self.final_delta(req, new_ids, text, new_logprobs, prompt)

    def hold(
        self,
        req: Request,
        token_id: int,
        text: str,
        logprobs: tuple[TokenLogprobs, ...] | None,
        prompt_logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> StreamDelta:
        """Prefill role: end the stream here but keep the blocks with the prompt's KV.

        The worker must end every held id's hand-off (the lease's end, ``release_held``
        or ``abort_request``), or its blocks stay in use for good.
        """
        self.scheduler.hold(req)
        # Not flushed: held-back text is emitted by the decode side, which continues the
        # same detokenizer state.
        self.detokenizers.pop(req.request_id, None)
        return StreamDelta(
            req.request_id,
            (token_id,),
            text,
            logprobs,
            finished=True,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            held_block_ids=self.handoff.held_block_ids(req.request_id),
            prompt_logprobs=prompt_logprobs,
        )

    def final_delta(
        self,
        req: Request,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs, ...] | None,
        prompt_logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> StreamDelta:
        detok = self.detokenizers.pop(req.request_id, None)
        if detok is not None and (req.stop_reason is None or isinstance(req.stop_reason, int)):
            text += detok.flush()  # held back for a stop string that never came
        return StreamDelta(
            req.request_id,
            token_ids,
            text,
            logprobs,
            finished=True,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
