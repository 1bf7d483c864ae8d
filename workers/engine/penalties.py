"""Logits edits before sampling: the logit bias, and those that depend on a row's token
history: penalties and min_tokens.

All take the step's logits [num_rows, vocab_size] and the rows, touch only the rows that
ask for it, and return either the input unchanged (no row asked) or an edited copy, so
the caller's logits (and the raw logits that logprobs are taken from) stay intact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from workers.engine.sampler import SamplingRow


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Adds each row's ``params.logit_bias`` (OpenAI's: token id -> bias) to its logits;
    ids past the logits' width are skipped (``validate_for_model`` refuses them first)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias:
            if token_id < vocab_size:
                row_ids.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    if not row_ids:
        return logits
    logits = logits.clone()
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    values = torch.tensor(biases, dtype=logits.dtype, device=device)
    logits.index_put_(index, values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty (HF: over prompt + output tokens, positive logits divided by the
    penalty, others multiplied), then presence / frequency penalties (OpenAI: over output
    tokens, `logit -= frequency * count + presence * (count > 0)`).

    Only the logits of tokens that occur are touched (gathered, edited, scattered back),
    so the cost follows the token histories, not rows x vocabulary.
    """
    repetition = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    additive = [
        i
        for i, row in enumerate(rows)
        if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if not repetition and not additive:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    (num_rows, vocab_size), device = logits.shape, logits.device
    flat_logits = logits.view(-1)  # position of (row i, token t): i * vocab_size + t
    if repetition:
        seen = np.zeros(num_rows * vocab_size, dtype=bool)
        seen[_flat_positions(rows, repetition, vocab_size, with_prompt=True)] = True
        positions = np.flatnonzero(seen)
        penalty = _per_row(rows, repetition, "repetition_penalty", 1.0)[positions // vocab_size]
        index = torch.from_numpy(positions).to(device)
        penalty = torch.from_numpy(penalty).to(device)
        values = flat_logits[index]
        flat_logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if additive:
        flat = _flat_positions(rows, additive, vocab_size, with_prompt=False)
        positions, counts = np.unique(flat, return_counts=True)
        row_ids = positions // vocab_size
        frequency = _per_row(rows, additive, "frequency_penalty", 0.0)[row_ids]
        presence = _per_row(rows, additive, "presence_penalty", 0.0)[row_ids]
        index = torch.from_numpy(positions).to(device)
        delta = frequency * counts.astype(np.float32) + presence
        flat_logits[index] -= torch.from_numpy(delta).to(device)
    return logits


def suppress_stop_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], *, copy: bool
) -> torch.Tensor:
    """Sets EOS and stop-token logits to -inf for rows that have generated fewer than
    `min_tokens` tokens. Edits a copy when `copy`, else `logits` in place."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            stops = row.eos_token_ids.union(row.params.stop_token_ids)
            suppressed = [t for t in stops if t < vocab_size]
            row_ids += [i] * len(suppressed)
            token_ids += suppressed
    if not row_ids:
        return logits
    if copy:
        logits = logits.clone()
    index = torch.tensor([row_ids, token_ids], device=logits.device)
    logits[index[0], index[1]] = -math.inf
    return logits


def _flat_positions(
    rows: Sequence[SamplingRow], row_ids: list[int], vocab_size: int, *, with_prompt: bool
) -> np.ndarray:
    """`row * vocab_size + token` for every token of the rows' outputs (and prompts)."""
    seqs = [
        (rows[i].prompt_token_ids, rows[i].output_token_ids)
        if with_prompt
        else (rows[i].output_token_ids,)
        for i in row_ids
    ]
    lengths = [sum(len(s) for s in parts) for parts in seqs]
    chained = itertools.chain.from_iterable(itertools.chain.from_iterable(seqs))
    tokens = np.fromiter(chained, dtype=np.int64, count=sum(lengths))
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return tokens + np.repeat(np.array(row_ids, dtype=np.int64) * vocab_size, lengths)


def _per_row(
    rows: Sequence[SamplingRow], row_ids: list[int], name: str, default: float
) -> np.ndarray:
    """One float32 value per batch row: the rows' `params.<name>`, `default` elsewhere."""
    values = np.full(len(rows), default, dtype=np.float32)
    values[row_ids] = [getattr(rows[i].params, name) for i in row_ids]
    return values
