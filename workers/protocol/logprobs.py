"""Logprobs of one sampled token: made by the sampler, carried to the router on the wire."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs (from the raw logits) of one sampled token and of the row's top tokens."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of tokens strictly more likely than the sampled one."""
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
