"""The draft's proposal loop over a step's speculating requests, on the lean forward.

Row ``i`` (a request with ``n`` tokens, the draft's KV computed for its first ``s``
positions, ``k`` proposals wanted) needs the draft's forward at positions ``s .. n - 1``
(*catch-up*: known tokens, usually one, two after a step that accepted every proposal)
and then ``n .. n + k - 2`` (each fed the proposal the step before made); the logits at
positions ``n - 1 .. n + k - 2`` give proposals ``1 .. k``. Every forward computes one
position of each row taking part:

- catch-up steps are aligned to end together, so their last one (which gives the first
  proposal) has every row, and earlier ones only the rows further behind (no logits);
- proposal steps take the rows in order of ``k``, largest first, so those still
  proposing are always a prefix of the batch (``k`` only differs near a request's end).

Where every row of a step is a plain greedy one (no penalties, no min_tokens still to
enforce: ``Sampler.process`` would leave its logits as they are), its proposal is the
logits' argmax and stays a tensor, fed straight into the next forward; the token ids come
to the host once, at the end. Other rows go through the sampler's processing, as the
target's verification will (``rejection.py``), and sampled rows draw from the draft's
processed distribution ``q``, which is returned for the rejection sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.engine.request import Request
from workers.engine.sampler import Sampler, SamplingRow, filtered_probs
from workers.engine.scheduler import ScheduledChunk
from workers.engine.speculative.draft_forward import LeanDraftForward
from workers.engine.speculative.rejection import draw_uniform, normalized, sample_from

# Catch-ups longer than this (tokens) go through the general path first, in one forward.
MAX_LEAN_CATCH_UP = 4


def is_plain_greedy(req: Request, num_proposed: int) -> bool:
    """Whether the sampler's processing leaves this request's logits unchanged at its
    next proposal (after ``num_proposed`` earlier ones) and it takes their argmax: greedy,
    no repetition/presence/frequency penalty, min_tokens reached, no grammar
    (``Sampler.process``)."""
    p = req.params
    return (
        p.is_greedy
        and req.grammar is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and req.num_output_tokens + num_proposed >= p.min_tokens
    )


@torch.inference_mode()
def propose_lean(
    lean: LeanDraftForward,
    verify: Sequence[tuple[ScheduledChunk, Request]],
    sampler: Sampler,
) -> dict[str, torch.Tensor | None]:
    """Fill in ``req.spec_token_ids`` of the verify chunks' requests (each at most
    ``MAX_LEAN_CATCH_UP`` positions behind); returns per request the distributions [k, V]
    its proposals were drawn from (None for greedy requests)."""
    rows = sorted(verify, key=lambda cr: -cr[0].num_spec)
    reqs = [r for _, r in rows]
    ks = [c.num_spec for c, _ in rows]
    behind = [r.num_tokens - r.draft_num_computed for r in reqs]
    assert min(behind) >= 1 and max(behind) <= MAX_LEAN_CATCH_UP
    device = lean.kv_cache.device
    table = np.zeros((len(rows), max(len(c.block_ids) for c, _ in rows)), dtype=np.int64)
    for i, (c, _) in enumerate(rows):
        table[i, : len(c.block_ids)] = c.block_ids
    tables = torch.from_numpy(table).to(device)

    num_catch_up = max(behind)
    logits = None
    for t in range(num_catch_up):
        active = [i for i in range(len(rows)) if behind[i] >= num_catch_up - t]
        positions = [reqs[i].num_tokens - (num_catch_up - t) for i in active]
        ids = torch.tensor(
            [reqs[i].token_ids[p] for i, p in zip(active, positions, strict=True)],
            dtype=torch.int64,
            device=device,
        )
        sub = tables if len(active) == len(rows) else tables[active]
        logits = lean.forward(ids, positions, sub, compute_logits=t == num_catch_up - 1)
    assert logits is not None

    chosen: list[torch.Tensor] = []  # per proposal step: the ids of its rows (a prefix)
    on_host = 0  # proposal steps already written to req.spec_token_ids
    probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    for j in range(ks[0]):
        num = sum(1 for k in ks if k > j)
        if j:
            positions = [r.num_tokens + j - 1 for r in reqs[:num]]
            logits = lean.forward(chosen[-1][:num], positions, tables[:num])
            assert logits is not None
        if all(is_plain_greedy(r, j) for r in reqs[:num]):
            chosen.append(logits.argmax(dim=-1))
            continue
        for step in range(on_host, j):  # the sampler's rows see the proposals so far
            for r, token in zip(reqs, chosen[step].tolist(), strict=False):
                r.spec_token_ids[step] = token
        on_host = j
        chosen.append(choose_proposals(logits, reqs[:num], j, sampler, probs))
    for step in range(on_host, len(chosen)):
        for r, token in zip(reqs, chosen[step].tolist(), strict=False):
            r.spec_token_ids[step] = token
    for c, r in rows:
        # Positions n - 1 .. n + k - 2 now hold the draft's KV (of proposals, so far).
        r.draft_num_computed = c.start_pos + c.num_spec
    return {
        r.request_id: torch.stack(probs[r.request_id]) if probs[r.request_id] else None
        for r in reqs
    }


def choose_proposals(
    logits: torch.Tensor,
    reqs: Sequence[Request],
    j: int,
    sampler: Sampler,
    probs: dict[str, list[torch.Tensor]],
) -> torch.Tensor:
    """Proposal ``j + 1`` of each row, through the sampler's processing: greedy rows take
    the processed argmax, sampled rows draw from ``q`` (kept in ``probs``)."""
    rows = [
        SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids + r.spec_token_ids[:j],
                    r.generator, r.eos_token_ids, r.grammar)
        for r in reqs
    ]  # fmt: skip
    _, x = sampler.process(logits, rows)
    ids = x.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if sampled:  # the distributions q the proposals are drawn from, in one pass
        index = torch.tensor(sampled, dtype=torch.long, device=x.device)
        q_rows = normalized(filtered_probs(x[index], [rows[i].params for i in sampled]))
        for i, q in zip(sampled, q_rows, strict=True):
            r = reqs[i]
            ids[i] = sample_from(q, draw_uniform(sampler, r.generator, 1)[0])
            probs[r.request_id].append(q)
    return ids
