"""Speculative decoding's parts on fixed tensors: the n-gram lookup, the greedy check and
rejection sampling's distribution (exactly the target's, whatever the proposals)."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine.request import Request
from workers.engine.sampler import Sampler
from workers.engine.speculative.gate import AcceptanceGate, StepMode
from workers.engine.speculative.ngram import NgramProposer
from workers.engine.speculative.rejection import RejectionSampler
from workers.engine.speculative.stats import SpecDecodeStats
from workers.protocol.sampling_params import SamplingParams


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(ngram_min=2, ngram_max=3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 2, 6, 7]
    # Suffix [2, 6, 7]: no earlier match; [6, 7]: at 1 and 6, the latest (6) is followed by 3 2.
    assert ngram.propose(tokens, 4) == [3, 2, 6, 7]
    assert ngram.propose(tokens, 1) == [3]
    # The longest match wins over a later shorter one: [1, 6, 7] recurs at 5.
    assert ngram.propose([*tokens[:8], 4, 1, 6, 7], 2) == [4, 1]
    assert ngram.propose([1, 2, 3, 4], 3) == []  # no suffix recurs
    assert NgramProposer(1, 1).propose([4, 9, 4], 2) == [9, 4]
    assert ngram.propose([7, 7], 2) == []  # too short to hold a match and a suffix


def test_stats_count_the_bonus_token_in_the_mean_accepted_length():
    stats = SpecDecodeStats().plus(4, 4).plus(4, 0)
    assert (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 8, 4)
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == 3.0  # (4 + 1 + 0 + 1) / 2
    assert SpecDecodeStats().acceptance_rate == 0.0


def request(params: SamplingParams, seed: int | None = None) -> Request:
    if seed is not None:
        params = SamplingParams(**{**params.__dict__, "seed": seed})
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return Request("r", [1, 2], params, 100, frozenset(), generator)


def test_greedy_verification_accepts_the_matching_prefix_then_the_targets_token():
    vocab = 6
    # Target argmax per position: 3, 1, 4, 0.
    logits = torch.full((4, vocab), -5.0)
    for row, token in enumerate([3, 1, 4, 0]):
        logits[row, token] = 5.0
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    rs = RejectionSampler(Sampler(vocab))
    out = rs(torch.cat([logits, logits, logits]), [request(greedy)] * 3,
             [[3, 1, 4], [3, 2, 4], [0, 1, 4]], [None] * 3)  # fmt: skip
    assert [o.token_ids for o in out] == [(3, 1, 4, 0), (3, 1), (3,)]
    assert [o.num_accepted for o in out] == [3, 1, 0]
    assert [lp.token_id for lp in out[1].logprobs] == [3, 1]
    assert out[1].logprobs[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[3]))


def test_greedy_verification_sees_penalties_of_the_accepted_proposals():
    vocab = 4
    # Every position prefers 2 slightly over 3; a repetition penalty on 2 flips that once
    # 2 is in the history, i.e. at row 1 after proposal 2 was accepted.
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.9]] * 3)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    req = Request("r", [0], params, 100, frozenset())
    out = RejectionSampler(Sampler(vocab))(logits, [req], [[2, 2]], [None])
    assert out[0].token_ids == (2, 3)


def chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    """P(X >= statistic) for Pearson's chi-square against ``probs`` (Wilson-Hilferty)."""
    n = sum(counts)
    cells = [(c, p) for c, p in zip(counts, probs, strict=True) if p > 0]
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in cells)
    dof = len(cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_rejection_sampling_keeps_the_targets_distribution(proposer):
    vocab, k, num = 5, 3, 6000
    gen = torch.Generator().manual_seed(0)
    # Position j's target logits do not depend on the history (no penalties), so every
    # emitted token at position j must follow p_j, accepted proposal or not.
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4)
    probs = torch.softmax(target_logits / 0.8, dim=-1)
    kth = probs.topk(4, dim=-1).values[:, -1:]
    p = probs * (probs >= kth)
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1)
    reqs = [request(params, seed=i) for i in range(num)]
    if proposer == "ngram":  # fixed proposals, one-hot q; one of them outside the top-k
        dropped = int(p[1].argmin())
        proposals = [[int(p[0].argmax()), dropped, int(p[2].argmin())]] * num
        draft_q = [None] * num
    else:
        proposals = [torch.multinomial(q, 1, generator=gen).squeeze(1).tolist() for _ in reqs]
        draft_q = [q] * num
    out = RejectionSampler(Sampler(vocab))(target_logits.repeat(num, 1), reqs, proposals, draft_q)
    by_position = [[0] * vocab for _ in range(k + 1)]
    for o in out:
        for j, token in enumerate(o.token_ids):
            by_position[j][token] += 1
    for j in range(k + 1):
        if sum(by_position[j]) >= 200:
            assert chi_square_p_value(by_position[j], p[j].tolist()) > 1e-3, (j, by_position[j])
    assert sum(by_position[1]) >= 200  # acceptances happen
    assert any(o.num_accepted < k for o in out)  # and rejections
    # Seeded: the same seeds give the same tokens.
    again = RejectionSampler(Sampler(vocab))(
        target_logits.repeat(50, 1), [request(params, seed=i) for i in range(50)],
        proposals[:50], draft_q[:50],
    )  # fmt: skip
    assert [o.token_ids for o in again] == [o.token_ids for o in out[:50]]


def test_the_gate_speculates_for_a_request_while_its_acceptance_pays():
    gate = AcceptanceGate()
    # Nothing measured: every request speculates (that measures the costs).
    assert gate.break_even(1) == 0.0 and gate.allows("a", 1)
    gate.observe(1, num_verified=1, seconds=0.016)
    assert gate.break_even(1) == 0.0  # the plain cost is still unknown
    gate.observe(1, num_verified=0, seconds=0.010)
    assert gate.break_even(1) == pytest.approx(0.6)
    gate.observe(16, num_verified=7, seconds=9.0)  # a mixed step says nothing
    assert gate.break_even(16) == 0.0
    gate.observe(16, num_verified=16, seconds=0.05)
    gate.observe(16, num_verified=0, seconds=0.02)
    assert gate.break_even(16) == pytest.approx(1.5)
    # "a" accepts one proposal a step: that pays at batch 1 (0.6 needed), not at 16 (1.5).
    for _ in range(40):
        gate.record("a", 1)
    assert gate.allows("a", 1)
    assert not gate.allows("a", 16)
    # "b" accepts four a step: it pulls the average over all requests up...
    for _ in range(40):
        gate.record("b", 4)
    assert gate.allows("b", 16)
    # ...and "a", sitting out at 16, drifts towards that average until it is tried again;
    # a try that accepts nothing sends it back below the line.
    sat_out = 0
    while not gate.allows("a", 16):
        sat_out += 1
    assert 1 <= sat_out < 30
    gate.record("a", 0)
    assert not gate.allows("a", 16)
    # A new request starts from the average over all requests.
    assert gate.allows("c", 16)
    gate.forget_all_but({"b"})
    assert set(gate._accepted) == {"b"}


def test_the_gate_measures_both_costs_then_explores_both_modes_now_and_then():
    gate = AcceptanceGate(explore_every=4)
    assert gate.step_mode(1) == StepMode.EVERYONE  # the cost of speculating, first
    assert gate.step_mode(1) == StepMode.EVERYONE  # still unmeasured: still trying
    gate.observe(1, num_verified=1, seconds=0.02)
    assert gate.step_mode(1) == StepMode.NOBODY  # then the plain cost
    gate.observe(1, num_verified=0, seconds=0.01)
    modes = [gate.step_mode(1) for _ in range(8)]
    assert modes.count(StepMode.EVERYONE) == 2 and modes.count(StepMode.NOBODY) == 2
    assert modes.count(StepMode.GATED) == 4
    assert gate.step_mode(16) == StepMode.EVERYONE  # another bucket keeps its own
    assert gate.costs()[5] == {} and set(gate.costs()[1]) == {True, False}
