"""What the router streams back for one request: :class:`GenerateEvent` after event, the
last one with a :class:`Finish` (built by ``router/stream.py``, converted to the wire by the
front end, ``router/server.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from workers.protocol.logprobs import TokenLogprobs

FinishReason = Literal["stop", "length", "abort"]
"""stop: EOS, a stop token id or a stop string; length: max_tokens or the context length;
abort: aborted, cancelled or drained."""


class Delta(NamedTuple):
    """New output since the previous event (possibly nothing, on a last event).

    A NamedTuple, as ``GenerateEvent``: immutable like a frozen dataclass, and built in
    under half its time (a frozen dataclass sets each field through ``object.__setattr__``);
    the router builds one of each per streamed chunk."""

    token_ids: tuple[int, ...] = ()
    text: str = ""  # whole UTF-8 characters; stop strings withheld; "" without return_text
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when asked for
    # Once, on the request's first event with tokens, when output.prompt_logprobs asked:
    # one per prompt token after the first (entry i scores prompt token i + 1).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_token_ids: tuple[int, ...] = ()  # with prompt_logprobs: the whole prompt's ids


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # served from a prefix cache


@dataclass(frozen=True)
class Timing:
    """Where one request's time went, as the router saw it (seconds)."""

    queue_seconds: float
    prefill_seconds: float
    kv_transfer_seconds: float
    kv_transfer_bytes: int
    ttft_seconds: float
    e2e_seconds: float
    prefill_worker: str  # empty when prefilled on the decode worker
    decode_worker: str


@dataclass(frozen=True)
class Finish:
    """How a request's output ended."""

    reason: FinishReason
    usage: Usage
    stop_string: str | None = None  # the stop string that ended it
    stop_token_id: int | None = None  # or the stop token id (not EOS)
    timing: Timing | None = None  # when the request asked for it (output.return_timing)


class GenerateEvent(NamedTuple):
    """One message of a request's stream; exactly the last one has ``finish``."""

    request_id: str
    delta: Delta
    finish: Finish | None = None
