"""Sampler: repetition / presence / frequency penalties and min_tokens (the logits
processors that run before sampling), on hand-computed cases."""

import math

import pytest
import torch

from tests.workers.test_sampler import row
from workers.engine.penalties import apply_penalties, suppress_stop_tokens
from workers.engine.sampler import Sampler
from workers.protocol.sampling_params import SamplingParams

# --- penalties ---------------------------------------------------------------------------


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    r = row(SamplingParams(repetition_penalty=2.0), prompt=[0, 4], output=[1, 1])
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, -8.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -4.0]]  # input untouched


def test_presence_and_frequency_penalties_hand_computed():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    r = row(params, prompt=[0, 1], output=[2, 2, 2, 5])  # prompt tokens not penalised
    out = apply_penalties(logits, [r])
    assert torch.allclose(out, torch.tensor([[1.0, 1.0, 1.0 - 1.5 - 0.25, 1.0, 1.0, 0.25]]))


def test_penalties_touch_only_their_rows_and_combine():
    logits = torch.tensor([[3.0, 2.0, -1.0], [3.0, 2.0, -1.0], [3.0, 2.0, -1.0]])
    rows = [
        row(SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), [2], [0]),
        row(SamplingParams(), [0, 1, 2], [0]),
        row(SamplingParams(presence_penalty=-1.0), [], [2]),
    ]
    out = apply_penalties(logits, rows)
    expected = [[3.0 / 1.5 - 1.0, 2.0, -1.5], [3.0, 2.0, -1.0], [3.0, 2.0, 0.0]]
    assert torch.allclose(out, torch.tensor(expected))


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    sampler = Sampler(3)
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    assert sampler(logits, [row(plain, prompt=[0])]).token_ids == [0]
    assert sampler(logits, [row(penalised, prompt=[0])]).token_ids == [1]


def test_token_ids_outside_the_vocabulary_are_rejected():
    r = row(SamplingParams(repetition_penalty=1.2), prompt=[1, 7])
    with pytest.raises(ValueError, match="7"):
        apply_penalties(torch.zeros(1, 5), [r])


# --- min_tokens --------------------------------------------------------------------------


def test_min_tokens_suppresses_eos_and_stop_token_ids():
    vocab_size, eos, stop = 10, 2, 7
    logits = torch.zeros(1, vocab_size)
    logits[0, eos], logits[0, stop] = 50.0, 40.0
    sampler = Sampler(vocab_size)
    for ignore_eos in (False, True):
        params = SamplingParams(
            temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=ignore_eos
        )
        tokens = [
            sampler(logits, [row(params, output=[5] * n, eos={eos})]).token_ids[0] for n in range(4)
        ]
        assert tokens[:3] != [eos] * 3 and eos not in tokens[:3] and stop not in tokens[:3]
        assert tokens[3] == eos


def test_min_tokens_holds_for_sampled_rows():
    logits = torch.zeros(500, 6)
    logits[:, 0] = 5.0  # EOS would be drawn most of the time
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    rows = [row(params, output=[1], eos={0}) for _ in range(500)]
    tokens = Sampler(6)(logits, rows).token_ids
    assert 0 not in tokens and 3 not in tokens
    assert set(tokens) == {1, 2, 4, 5}


def test_min_tokens_does_not_touch_the_input():
    logits = torch.zeros(1, 4)
    r = row(SamplingParams(min_tokens=1), eos={1})
    out = suppress_stop_tokens(logits, [r], copy=True)
    assert out[0, 1] == -math.inf and logits[0, 1] == 0.0
