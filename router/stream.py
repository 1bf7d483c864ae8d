"""One request's output at the edge: token events in, :class:`~router.events.GenerateEvent` out.

Workers send token ids only; the router detokenizes incrementally here (never broken
UTF-8) and applies stop *strings*, which only text can decide. A stop string ends the
output at the token that completed it, exactly as the single-process engine does, and
the caller aborts the request on the worker. EOS, stop token ids and lengths are
decided by the worker's engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.events import Delta, Finish, FinishReason, GenerateEvent, Timing, Usage
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.wire import TokenEvent
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer

_FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")


@dataclass
class Stamps:
    """Router-side clock readings (monotonic seconds) of one request, and its workers."""

    accepted: float = field(default_factory=time.monotonic)
    submitted: float = 0.0  # sent to the first worker
    first_token: float = 0.0
    kv_transfer_seconds: float = 0.0
    kv_transfer_bytes: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""


class RequestStream:
    """Turns a request's token events into client events; knows when the output ended."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        *,
        return_text: bool,
        return_timing: bool,
        public_id: str | None = None,
    ):
        """``request_id`` is the router's and the workers' id of the request;
        ``public_id`` the client's, which its events carry (default: the same)."""
        self.request_id = request_id
        self.public_id = request_id if public_id is None else public_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.return_text = return_text
        self.return_timing = return_timing
        self.stamps = Stamps()
        self.output_token_ids: list[int] = []  # sent to the client (a migration resumes here)
        self.num_cached_tokens = 0
        self.is_finished = False
        self.finish: Finish | None = None  # the last event's, once the output ended
        # Prompt logprobs go to the client once (a migrated request's new worker is not
        # asked again: attempt.plan strips them from a resumed request's params).
        self.has_sent_prompt_logprobs = False
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def on_event(self, event: TokenEvent) -> GenerateEvent | None:
        """The client event for one worker event (None when it carries nothing to send).

        After an event with a Finish, ``is_finished`` is True; a stop string can finish the
        output before the worker knows (the caller then aborts it there).
        """
        if self.is_finished:
            return None
        token_ids = event.token_ids
        outputs = self.output_token_ids
        if token_ids and not outputs:
            self.stamps.first_token = time.monotonic()
        if event.num_cached_tokens:
            # A migrated request's worker may have found its earlier output cached too.
            num_cached = min(event.num_cached_tokens, len(self.prompt_token_ids))
            self.num_cached_tokens = max(self.num_cached_tokens, num_cached)
        if event.kv_transfer_seconds or event.kv_transfer_bytes:
            self.stamps.kv_transfer_seconds += event.kv_transfer_seconds
            self.stamps.kv_transfer_bytes += event.kv_transfer_bytes
        stop_string = None
        # Token by token, so that a stop string cuts at the token that completed it, and
        # the text of whole characters goes out even when the last token ends mid-character.
        step, min_tokens = self._detok.step, self.params.min_tokens
        text = ""
        for i, token_id in enumerate(token_ids):
            outputs.append(token_id)
            # Stop strings count once min_tokens are out, as in the engine.
            released = step((token_id,), len(outputs) >= min_tokens)
            text += released.text
            if released.stop_matched is not None:
                stop_string = released.stop_matched
                token_ids = token_ids[: i + 1]
                break
        prompt = None
        if event.prompt_logprobs is not None and not self.has_sent_prompt_logprobs:
            prompt, self.has_sent_prompt_logprobs = event.prompt_logprobs, True
        if stop_string is not None:
            delta = self._delta(token_ids, text, event.logprobs, prompt)
            return self._final(delta, "stop", stop_string=stop_string)
        if event.finished:
            text += self._detok.flush()  # held back for a stop string that never came
            reason = event.finish_reason if event.finish_reason in _FINISH_REASONS else "abort"
            delta = self._delta(token_ids, text, event.logprobs, prompt)
            return self._final(delta, reason, stop_token_id=event.stop_token_id)  # type: ignore[arg-type]
        if not token_ids:
            return None
        return GenerateEvent(self.public_id, self._delta(token_ids, text, event.logprobs, prompt))

    def abort_event(self) -> GenerateEvent:
        """The last event of an output cut short by an abort (or a drain past its grace)."""
        return self._final(self._delta([], self._detok.flush(), None), "abort")

    # ---- building events --------------------------------------------------------------
    def _delta(
        self,
        token_ids: Sequence[int],
        text: str,
        logprobs: Sequence[TokenLogprobs] | None,
        prompt_logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> Delta:
        # A stop string can end the output before the event's last token: its logprobs go too.
        if not logprobs:
            kept: tuple[TokenLogprobs, ...] = ()
        elif len(logprobs) > len(token_ids):
            kept = tuple(logprobs[: len(token_ids)])
        else:
            kept = tuple(logprobs)
        text = text if self.return_text else ""
        if prompt_logprobs is None:
            return Delta(tuple(token_ids), text, kept)
        prompt = tuple(self.prompt_token_ids)
        return Delta(tuple(token_ids), text, kept, prompt_logprobs, prompt)

    def _final(
        self,
        delta: Delta,
        reason: FinishReason,
        *,
        stop_string: str | None = None,
        stop_token_id: int | None = None,
    ) -> GenerateEvent:
        self.is_finished = True
        self.finish = finish = Finish(
            reason=reason,
            usage=Usage(
                prompt_tokens=len(self.prompt_token_ids),
                completion_tokens=self.num_output_tokens,
                cached_prompt_tokens=self.num_cached_tokens,
            ),
            stop_string=stop_string,
            stop_token_id=stop_token_id,
            timing=self._timing() if self.return_timing else None,
        )
        return GenerateEvent(self.public_id, delta, finish)

    def _timing(self) -> Timing:
        t = self.stamps
        now = time.monotonic()
        submitted = t.submitted or now
        first = t.first_token or now
        return Timing(
            queue_seconds=submitted - t.accepted,
            prefill_seconds=max(0.0, first - submitted),
            kv_transfer_seconds=t.kv_transfer_seconds,
            kv_transfer_bytes=t.kv_transfer_bytes,
            ttft_seconds=first - t.accepted,
            e2e_seconds=now - t.accepted,
            prefill_worker=t.prefill_worker,
            decode_worker=t.decode_worker,
        )


def merge_events(events: Sequence[GenerateEvent]) -> GenerateEvent:
    """Consecutive events of one request as one: their tokens, text and logprobs in order,
    the prompt's logprobs of the one that has them, the last one's Finish."""
    if len(events) == 1:
        return events[0]
    deltas = [e.delta for e in events]
    prompt = next((d for d in deltas if d.prompt_logprobs is not None), None)
    delta = Delta(
        tuple(t for d in deltas for t in d.token_ids),
        "".join(d.text for d in deltas),
        tuple(lp for d in deltas for lp in d.logprobs),
        prompt.prompt_logprobs if prompt is not None else None,
        prompt.prompt_token_ids if prompt is not None else (),
    )
    return GenerateEvent(events[-1].request_id, delta, events[-1].finish)
