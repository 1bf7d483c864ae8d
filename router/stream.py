"""One request's output at the edge: token events in, ``GenerateResponse`` messages out.

Workers send token ids only; the router detokenizes incrementally here (never broken
UTF-8) and applies stop *strings*, which only text can decide. A stop string ends the
output at the token that completed it, exactly as the single-process engine does, and
the caller aborts the request on the worker. EOS, stop token ids and lengths are
decided by the worker's engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from proto.baton.v1 import inference_pb2 as pb
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.wire import TokenEvent
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


@dataclass
class Timing:
    """Router-side clock readings (monotonic seconds) of one request."""

    accepted: float = field(default_factory=time.monotonic)
    submitted: float = 0.0  # sent to the first worker
    first_token: float = 0.0
    kv_transfer_seconds: float = 0.0
    kv_transfer_bytes: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""


class RequestStream:
    """Turns a request's token events into client messages; knows when the output ended."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        *,
        return_text: bool,
        return_timing: bool,
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.return_text = return_text
        self.return_timing = return_timing
        self.timing = Timing()
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.is_finished = False
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
        )

    def on_event(self, event: TokenEvent) -> pb.GenerateResponse | None:
        """The client message for one worker event (None when it carries nothing to send).

        After a message with a Final, ``is_finished`` is True; a stop string can finish the
        output before the worker knows (the caller then aborts it there).
        """
        if self.is_finished:
            return None
        if self.num_output_tokens == 0 and event.token_ids:
            self.timing.first_token = time.monotonic()
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        self.timing.kv_transfer_seconds += event.kv_transfer_seconds
        self.timing.kv_transfer_bytes += event.kv_transfer_bytes
        token_ids: list[int] = []
        text_parts: list[str] = []
        stop_string = None
        for token_id in event.token_ids:
            token_ids.append(token_id)
            self.num_output_tokens += 1
            # Stop strings count once min_tokens are out, as in the engine.
            check_stop = self.num_output_tokens >= self.params.min_tokens
            step = self._detok.step([token_id], check_stop=check_stop)
            text_parts.append(step.text)
            if step.stop_matched is not None:
                stop_string = step.stop_matched
                break
        delta = self._delta(token_ids, "".join(text_parts), event.logprobs, len(token_ids))
        if stop_string is not None:
            return self._final(delta, pb.FINISH_REASON_STOP, stop_string=stop_string)
        if event.finished:
            delta.text += self._flush()  # held back for a stop string that never came
            reason = _FINISH.get(event.finish_reason or "abort", pb.FINISH_REASON_ABORT)
            return self._final(delta, reason, stop_token_id=event.stop_token_id)
        if not token_ids:
            return None
        return pb.GenerateResponse(request_id=self.request_id, delta=delta)

    def abort_message(self) -> pb.GenerateResponse:
        """The Final of an output cut short by ``Abort`` (or a drain past its grace)."""
        delta = self._delta([], self._flush(), None, 0)
        return self._final(delta, pb.FINISH_REASON_ABORT)

    # ---- building messages ------------------------------------------------------------
    def _flush(self) -> str:
        text = self._detok.flush()
        return text if self.return_text else ""

    def _delta(
        self,
        token_ids: list[int],
        text: str,
        logprobs: tuple[TokenLogprobs, ...] | None,
        num_kept: int,
    ) -> pb.Delta:
        delta = pb.Delta(token_ids=token_ids, text=text if self.return_text else "")
        if logprobs is not None:
            for lp in logprobs[:num_kept]:
                delta.logprobs.append(
                    pb.TokenLogprob(
                        token_id=lp.token_id,
                        logprob=lp.logprob,
                        rank=lp.rank,
                        top=[
                            pb.TopLogprob(token_id=t, logprob=v)
                            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                        ],
                    )
                )
        return delta

    def _final(
        self,
        delta: pb.Delta,
        reason: int,
        *,
        stop_string: str | None = None,
        stop_token_id: int | None = None,
    ) -> pb.GenerateResponse:
        self.is_finished = True
        final = pb.Final(
            finish_reason=reason,
            usage=pb.Usage(
                prompt_tokens=len(self.prompt_token_ids),
                completion_tokens=self.num_output_tokens,
                cached_prompt_tokens=self.num_cached_tokens,
            ),
            delta=delta,
        )
        if stop_string is not None:
            final.stop_string = stop_string
        elif stop_token_id is not None:
            final.stop_token_id = stop_token_id
        if self.return_timing:
            final.timing.CopyFrom(self._timing())
        return pb.GenerateResponse(request_id=self.request_id, final=final)

    def _timing(self) -> pb.Timing:
        t = self.timing
        now = time.monotonic()
        submitted = t.submitted or now
        first = t.first_token or now
        return pb.Timing(
            queue_seconds=submitted - t.accepted,
            prefill_seconds=max(0.0, first - submitted),
            kv_transfer_seconds=t.kv_transfer_seconds,
            kv_transfer_bytes=t.kv_transfer_bytes,
            ttft_seconds=first - t.accepted,
            e2e_seconds=now - t.accepted,
            prefill_worker=t.prefill_worker,
            decode_worker=t.decode_worker,
        )
