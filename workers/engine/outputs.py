"""What the engine hands back: per-step deltas, and whole completions for ``LLM.generate``."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.request import FinishReason
from workers.protocol.logprobs import TokenLogprobs


@dataclass(frozen=True)
class StreamDelta:
    """New output of one request in one engine step (the streaming interface)."""

    request_id: str
    token_ids: tuple[int, ...]  # new token ids this step
    text: str  # new text (complete UTF-8 characters only; stop strings withheld)
    logprobs: tuple[TokenLogprobs, ...] | None  # one per new token, when asked for
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Prefill role only, on the final delta of a request added with prefill_only=True that
    # did not end at its first token: the blocks that keep the prompt's KV (the block table,
    # ceil(num_prompt_tokens / block_size) blocks) until its hand-off frees them
    # (workers/engine/handoff.py).
    held_block_ids: tuple[int, ...] | None = None
    # With ``params.prompt_logprobs``, on the request's first delta with tokens: one per
    # prompt token after the first (entry i scores prompt token i + 1, from the raw logits
    # at position i); None otherwise.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """A finished request, as ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    stop_reason: str | int | None
    logprobs: tuple[TokenLogprobs, ...] | None
    num_cached_tokens: int
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """With ``params.prompt_logprobs``: one per prompt token, the first None (nothing
    precedes it), as vLLM's ``RequestOutput.prompt_logprobs``; None when not asked for."""
