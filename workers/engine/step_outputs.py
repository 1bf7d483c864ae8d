"""A request's new tokens into its stream: detokenize, check the stops, finish or hold.

One engine step appends one token per request, or several for a speculative verify step
(the accepted proposals and the target's own token): the stop conditions are checked
after each, and the tokens after one that ends the request are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.handoff import KVHandoff
from workers.engine.outputs import StreamDelta
from workers.engine.request import Request, check_stop
from workers.engine.scheduler import Scheduler
from workers.protocol.logprobs import TokenLogprobs
from workers.text.detokenizer import IncrementalDetokenizer


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
        if reason is None and req.is_prefill_only:
            return self.hold(req, new_ids[0], text, new_logprobs)
        if reason is None:
            return StreamDelta(
                req.request_id,
                new_ids,
                text,
                new_logprobs,
                finished=False,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
        req.stop_reason = stop_reason
        self.scheduler.finish(req, reason)
        return self.final_delta(req, new_ids, text, new_logprobs)

    def hold(
        self,
        req: Request,
        token_id: int,
        text: str,
        logprobs: tuple[TokenLogprobs, ...] | None,
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
        )

    def final_delta(
        self,
        req: Request,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs, ...] | None,
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
        )
