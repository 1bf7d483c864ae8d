"""Prompt logprobs: how likely the model found each prompt token, given the ones before it.

A request with ``params.prompt_logprobs`` has its chunks' prompt positions computed with
logits (``ScheduledChunk.num_prompt_logprobs``; the model runner appends those rows after
the sampled ones). The logits at position ``p`` score prompt token ``p + 1``, from the raw
model (before any logit bias, penalty or grammar mask, as the sampled tokens' logprobs).
The request accumulates them chunk by chunk (``Request.add_prompt_logprobs``) and its first
delta with tokens carries them all (``Request.take_prompt_logprobs``).

Such a request takes no prefix-cache or KV-tier hit (``workers/engine/admission.py``) and
no peer's prefix, so every position is computed here; a decode worker's request gets them
from its prefill worker's event. Only such requests pay for the extra rows: ``rows x
vocabulary`` float32 logits per step (a 2,048-token chunk of a 49k vocabulary: 400 MB),
turned into logprobs in slices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.request import Request
from workers.engine.sampler import token_logprobs
from workers.engine.scheduler import ScheduledChunk
from workers.protocol.logprobs import TokenLogprobs

_ROWS_PER_SLICE = 256  # bounds log_softmax's temporary to 256 x vocabulary floats


def prompt_logprobs(
    logits: torch.Tensor,
    chunks: Sequence[tuple[ScheduledChunk, Request | None]],
    vocab_size: int,
) -> dict[str, list[TokenLogprobs]]:
    """The prompt logprobs of a batch's chunks, by request id. ``logits`` holds
    ``chunk.num_prompt_logprobs`` rows per chunk, in the batch's order; ``chunks`` pairs
    every chunk of the batch with its request, None where it is no longer scheduled
    (aborted while in flight: its rows are skipped)."""
    row = 0
    index: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    owners: list[tuple[str, int]] = []  # (request id, number of rows)
    for chunk, req in chunks:
        n = chunk.num_prompt_logprobs
        if n and req is not None:
            start = chunk.start_pos + 1
            index.extend(range(row, row + n))
            targets.extend(req.prompt_token_ids[start : start + n])
            ks.extend([req.params.prompt_logprobs or 0] * n)
            owners.append((req.request_id, n))
        row += n
    out: list[TokenLogprobs] = []
    for lo in range(0, len(index), _ROWS_PER_SLICE):
        rows = torch.tensor(index[lo : lo + _ROWS_PER_SLICE], device=logits.device)
        raw = logits[rows, :vocab_size].float()
        ids = targets[lo : lo + _ROWS_PER_SLICE]
        ids_t = torch.tensor(ids, device=logits.device)
        out.extend(token_logprobs(raw, ids_t, ids, ks[lo : lo + _ROWS_PER_SLICE]))
    by_request: dict[str, list[TokenLogprobs]] = {}
    pos = 0
    for request_id, n in owners:
        by_request[request_id] = out[pos : pos + n]
        pos += n
    return by_request
