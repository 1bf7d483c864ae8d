"""Logprobs of one sampled token: made by the sampler, carried to the router on the wire."""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Logprobs (from the raw logits) of one sampled token and of the row's top tokens.

    A msgspec struct: it travels inside a :class:`~workers.protocol.wire.TokenEvent` as a
    positional array ``[token_id, logprob, rank, top_token_ids, top_logprobs]``."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of tokens strictly more likely than the sampled one."""
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
