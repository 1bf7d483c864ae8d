"""Verifying proposals against the target: greedy matching and rejection sampling.

A verify chunk of a request with ``k`` proposals ``d_1..d_k`` gives the target's logits at
``k + 1`` positions; position ``j`` predicts the token after ``d_1..d_j``. Each row is
processed exactly as the plain sampler would process it had ``d_1..d_j`` been generated
(penalties and min_tokens see them, then temperature, top-k, top-p, min-p), so:

- greedy rows accept ``d_{j+1}`` while it equals the target's argmax at position ``j``;
  the first mismatch is replaced by that argmax, and after ``k`` accepted proposals the
  argmax at position ``k`` is the bonus token. Output is token for token what decoding
  one token at a time gives.
- sampled rows use speculative rejection sampling (Leviathan et al. 2023; Chen et al.
  2023): ``d_{j+1}``, drawn from the proposer's distribution ``q``, is accepted with
  probability ``min(1, p(d) / q(d))``; on rejection the token is drawn from
  ``normalize(max(0, p - q))``; after ``k`` acceptances the bonus is drawn from ``p``.
  Each emitted token is then distributed exactly as ``p``. An n-gram proposal is
  deterministic: ``q`` is one-hot, so ``d`` is accepted with probability ``p(d)`` and the
  residual is ``p`` without ``d``.

Randomness: a sampled request draws ``k + 1`` uniforms per verify step (one per proposal,
one for the last token), from its own generator when seeded, else the shared one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.request import Request
from workers.engine.sampler import (
    Sampler,
    SamplingRow,
    compute_logprobs,
    filtered_probs,
)
from workers.protocol.logprobs import TokenLogprobs


@dataclass(frozen=True)
class Verified:
    """One request's outcome of a verify step."""

    token_ids: tuple[int, ...]
    """The accepted proposals, then the target's own token (correction or bonus)."""
    logprobs: tuple[TokenLogprobs | None, ...]
    """One per token (None entries where the request asked for none)."""
    num_accepted: int
    """Proposals accepted: ``len(token_ids) - 1``."""


def verify_rows(req: Request, proposals: Sequence[int]) -> list[SamplingRow]:
    """The k + 1 rows of a verify chunk: row j as if ``proposals[:j]`` were generated."""
    output = req.output_token_ids
    return [
        SamplingRow(
            req.params,
            req.prompt_token_ids,
            output + list(proposals[:j]),
            req.generator,
            req.eos_token_ids,
            req.grammar,
        )
        for j in range(len(proposals) + 1)
    ]


def normalized(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def draw_uniform(sampler: Sampler, generator: torch.Generator | None, num: int) -> list[float]:
    """``num`` uniforms in [0, 1) from the request's generator (or the shared one)."""
    if generator is None:
        generator = sampler.shared_generator(torch.device("cpu"))
    return torch.rand(
        num, generator=generator, device=generator.device, dtype=torch.float64
    ).tolist()


def sample_from(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF draw from one unnormalised row of non-negative weights."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[-1]
    target = torch.minimum(total * uniform, torch.nextafter(total, torch.zeros_like(total)))
    token = int(torch.searchsorted(cdf, target.reshape(1), right=True)[0])
    return min(token, probs.shape[-1] - 1)


class RejectionSampler:
    """Verifies a step's proposals; shares the plain sampler's processing and generator."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        proposals: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
    ) -> list[Verified]:
        """``logits``: ``len(proposals[i]) + 1`` rows per request, in order. ``draft_probs``:
        per request the normalised distributions [k, V] its proposals were drawn from, or
        None for deterministic (n-gram) proposals."""
        rows: list[SamplingRow] = []
        for req, props in zip(requests, proposals, strict=True):
            rows += verify_rows(req, props)
        raw, x = self.sampler.process(logits, rows)
        greedy_ids = x.argmax(dim=-1).tolist()
        # The target's distributions of every sampled row, in one pass: [rows, V].
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        p_all = None
        if sampled:
            index = torch.tensor(sampled, dtype=torch.long, device=x.device)
            p_all = normalized(filtered_probs(x[index], [rows[i].params for i in sampled]))
        p_start = 0
        results: list[Verified] = []
        start = 0
        emitted_rows: list[int] = []
        emitted_ids: list[int] = []
        for req, props, q in zip(requests, proposals, draft_probs, strict=True):
            k = len(props)
            if req.params.is_greedy:
                tokens = _greedy(props, greedy_ids[start : start + k + 1])
            else:
                assert p_all is not None
                tokens = self._sample(req, props, p_all[p_start : p_start + k + 1], q)
                p_start += k + 1
            emitted_rows += range(start, start + len(tokens))
            emitted_ids += tokens
            results.append(Verified(tuple(tokens), (), len(tokens) - 1))
            start += k + 1
        return self._with_logprobs(results, raw, rows, emitted_rows, emitted_ids)

    def _sample(
        self,
        req: Request,
        proposals: Sequence[int],
        p: torch.Tensor,
        q: torch.Tensor | None,
    ) -> list[int]:
        """``p``: the target's normalised distributions [k + 1, V]."""
        k = len(proposals)
        uniform = draw_uniform(self.sampler, req.generator, k + 1)
        index = torch.tensor(list(proposals), dtype=torch.long, device=p.device)
        rows = torch.arange(k, device=p.device)
        p_at = p[rows, index].tolist()
        q_at = q[rows, index].tolist() if q is not None else [1.0] * k
        tokens: list[int] = []
        for j in range(k):
            # Accept with probability min(1, p/q): u < p/q, written without the division.
            if uniform[j] * q_at[j] < p_at[j]:
                tokens.append(proposals[j])
                continue
            if q is None:
                residual = p[j].clone()
                residual[proposals[j]] = 0.0
            else:
                residual = (p[j] - q[j]).clamp_(min=0.0)
            if not float(residual.max()) > 0.0:  # p == q up to rounding: nothing left
                residual = p[j]
            tokens.append(sample_from(residual, uniform[k]))
            return tokens
        tokens.append(sample_from(p[k], uniform[k]))
        return tokens

    def _with_logprobs(
        self,
        results: list[Verified],
        raw: torch.Tensor,
        rows: list[SamplingRow],
        emitted_rows: list[int],
        emitted_ids: list[int],
    ) -> list[Verified]:
        if all(row.params.logprobs is None for row in rows):
            return [
                Verified(r.token_ids, (None,) * len(r.token_ids), r.num_accepted) for r in results
            ]
        index = torch.tensor(emitted_rows, dtype=torch.long, device=raw.device)
        ids = torch.tensor(emitted_ids, dtype=torch.long, device=raw.device)
        lps = compute_logprobs(raw[index], [rows[i].params for i in emitted_rows], ids, emitted_ids)
        out, start = [], 0
        for r in results:
            n = len(r.token_ids)
            out.append(Verified(r.token_ids, tuple(lps[start : start + n]), r.num_accepted))
            start += n
        return out


def _greedy(proposals: Sequence[int], targets: list[int]) -> list[int]:
    tokens: list[int] = []
    for j, proposal in enumerate(proposals):
        if proposal != targets[j]:
            break
        tokens.append(proposal)
    tokens.append(targets[len(tokens)])
    return tokens
