import numpy as np
import pytest
import torch

from workers.engine.sampler import Sampler, SamplingRow, make_generator
from workers.protocol.sampling_params import SamplingParams


def row(
    params: SamplingParams,
    prompt=(),
    output=(),
    eos=frozenset(),
    generator: torch.Generator | None = None,
) -> SamplingRow:
    if generator is None:
        generator = make_generator(params)
    return SamplingRow(params, list(prompt), list(output), generator, frozenset(eos))


def draws(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, reps: int) -> np.ndarray:
    """Token ids [reps, num_rows]: the same logits sampled `reps` times, unseeded."""
    rows = [row(params) for _ in range(logits.shape[0])]
    return np.array([sampler(logits, rows).token_ids for _ in range(reps)])


def softmax64(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.double(), dim=-1).numpy()


# --- greedy ------------------------------------------------------------------------------


def test_greedy_is_argmax_of_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    out = Sampler(300)(logits, [row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.5) for i in range(8)]
    out = Sampler(50)(logits, [row(p) for p in params])
    expected = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == expected[1::2]


# --- padded vocabulary -------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.01, seed=3),
    ],
)
def test_padding_columns_never_sampled(params):
    vocab_size, padded = 40, 64
    logits = torch.randn(64, padded)
    logits[:, vocab_size:] = 1e4  # would win everything if looked at
    sampler = Sampler(vocab_size)
    for _ in range(5):
        out = sampler(logits, [row(params) for _ in range(64)])
        assert max(out.token_ids) < vocab_size


# --- seeded reproducibility --------------------------------------------------------------


SEEDED_CASES = [
    SamplingParams(temperature=0.9, seed=1234),
    SamplingParams(top_p=0.9, seed=7),  # flat logits: wide nucleus, the full-sort path
    SamplingParams(top_k=20, top_p=0.8, min_p=0.02, temperature=1.3, seed=99),
    SamplingParams(top_p=0.95, seed=5, repetition_penalty=1.3, frequency_penalty=0.4),
]


@pytest.mark.parametrize("params", SEEDED_CASES)
def test_seeded_tokens_do_not_depend_on_neighbours_or_position(params):
    vocab_size, num_steps = 500, 40
    gen = torch.Generator().manual_seed(0)
    alone = Sampler(vocab_size, seed=1)
    crowded = Sampler(vocab_size, seed=2)
    mine_alone = make_generator(params)
    mine_crowded = make_generator(params)
    output: list[int] = []
    tokens_alone, tokens_crowded = [], []
    neighbour_params = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, seed=11),
        SamplingParams(top_p=0.3, min_p=0.1),
        SamplingParams(top_p=0.99, temperature=0.5, seed=3),
    ]
    for step in range(num_steps):
        my_logits = torch.randn(1, vocab_size, generator=gen) * 0.5
        a = alone(my_logits, [row(params, [1, 2, 3], output, generator=mine_alone)])
        # A different number of neighbours each step, and the row in a different place.
        num_neighbours = step % 6
        position = step % (num_neighbours + 1)
        rows = [row(p) for p in neighbour_params[:num_neighbours]]
        batch = torch.randn(num_neighbours + 1, vocab_size, generator=gen) * (step % 3 + 1)
        rows.insert(position, row(params, [1, 2, 3], output, generator=mine_crowded))
        batch[position] = my_logits[0]
        b = crowded(batch, rows)
        tokens_alone.append(a.token_ids[0])
        tokens_crowded.append(b.token_ids[position])
        output.append(a.token_ids[0])
    assert tokens_alone == tokens_crowded
    assert len(set(tokens_alone)) > num_steps // 2  # really random, not stuck


def test_same_seed_same_stream_different_seed_different_stream():
    logits = torch.zeros(1, 1000)  # uniform: every draw is visible in the token
    sampler = Sampler(1000)

    def stream(seed: int) -> list[int]:
        params = SamplingParams(seed=seed)
        g = make_generator(params)
        return [sampler(logits, [row(params, generator=g)]).token_ids[0] for _ in range(20)]

    assert stream(3) == stream(3)
    assert stream(3) != stream(4)


def test_make_generator_resumes_after_sampled_steps():
    """The prefill worker samples the first token; the decode worker resumes the stream."""
    params = SamplingParams(top_p=0.9, seed=2024)
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(5))
    sampler = Sampler(300)
    g = make_generator(params)
    straight = [
        sampler(logits[i : i + 1], [row(params, generator=g)]).token_ids[0] for i in range(12)
    ]
    resumed = make_generator(params, num_sampled_steps=4)
    rest = [
        sampler(logits[i : i + 1], [row(params, generator=resumed)]).token_ids[0]
        for i in range(4, 12)
    ]
    assert rest == straight[4:]
    assert make_generator(SamplingParams()) is None


def test_unseeded_rows_differ_between_steps_and_rows():
    logits = torch.zeros(32, 1000)
    sampler = Sampler(1000)
    rows = [row(SamplingParams()) for _ in range(32)]
    first, second = sampler(logits, rows).token_ids, sampler(logits, rows).token_ids
    assert first != second
    assert len(set(first)) > 20


def test_sampler_seed_makes_unseeded_batches_reproducible():
    logits = torch.zeros(8, 1000)
    rows = [row(SamplingParams()) for _ in range(8)]
    assert (
        Sampler(1000, seed=5)(logits, rows).token_ids
        == Sampler(1000, seed=5)(logits, rows).token_ids
    )


# --- distribution and filters ------------------------------------------------------------


def assert_frequencies_match(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Every token's count within 5 standard deviations of its expectation."""
    n = tokens.size
    counts = np.bincount(tokens.ravel(), minlength=probs.size)
    sd = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= 5 * sd + 1), (counts, n * probs)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_frequencies_match_softmax_over_temperature(temperature):
    torch.manual_seed(3)
    logits = torch.randn(1, 8) * 2
    sampler = Sampler(8)
    tokens = draws(sampler, logits.expand(4000, 8), SamplingParams(temperature=temperature), 5)
    assert_frequencies_match(tokens, softmax64(logits[0] / temperature))


def test_seeded_rows_follow_the_same_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    sampler = Sampler(5)
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(4000)]
    out = sampler(logits.expand(4000, 5), [row(p) for p in params])
    assert_frequencies_match(np.array(out.token_ids), softmax64(logits[0] / 0.8))


def test_top_k_samples_only_and_all_of_the_k_largest():
    torch.manual_seed(4)
    vocab_size, num_rows = 100, 64
    logits = torch.randn(num_rows, vocab_size)
    sampler = Sampler(vocab_size)
    for k in (1, 5, 17):
        tokens = draws(sampler, logits, SamplingParams(top_k=k), 40)
        for i in range(num_rows):
            allowed = set(np.argsort(-logits[i].numpy())[:k].tolist())
            assert set(tokens[:, i].tolist()) <= allowed
        if k == 5:  # 40 draws of 5 tokens: each of them shows up in aggregate
            pooled = {(i, t) for i in range(num_rows) for t in tokens[:, i].tolist()}
            expected = {(i, t) for i in range(num_rows) for t in np.argsort(-logits[i].numpy())[:k]}
            assert len(pooled) > 0.95 * len(expected)


def nucleus(probs: np.ndarray, top_p: float) -> set[int] | None:
    """The smallest most-likely set with mass >= top_p; None when the boundary is too close
    to call in float32."""
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    size = int(np.searchsorted(cum, top_p) + 1)  # first index with cum >= top_p
    if np.min(np.abs(cum - top_p)) < 1e-5:
        return None
    return set(order[:size].tolist())


@pytest.mark.parametrize(("scale", "top_p"), [(3.0, 0.5), (3.0, 0.9), (0.3, 0.9), (1.0, 0.2)])
def test_top_p_samples_only_the_nucleus(scale, top_p):
    # scale 0.3 is nearly flat: the nucleus is wider than the first candidates (full sort).
    torch.manual_seed(5)
    vocab_size, num_rows = 200, 48
    logits = torch.randn(num_rows, vocab_size) * scale
    tokens = draws(Sampler(vocab_size), logits, SamplingParams(top_p=top_p), 30)
    checked = 0
    for i in range(num_rows):
        allowed = nucleus(softmax64(logits[i]), top_p)
        if allowed is not None:
            assert set(tokens[:, i].tolist()) <= allowed
            checked += 1
    assert checked > num_rows * 0.8


def test_top_p_frequencies_follow_the_renormalised_nucleus():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -2.0]])
    probs = softmax64(logits[0])
    keep = sorted(nucleus(probs, 0.8))
    assert keep == [0, 1, 2]
    expected = np.zeros(6)
    expected[keep] = probs[keep] / probs[keep].sum()
    tokens = draws(Sampler(6), logits.expand(4000, 6), SamplingParams(top_p=0.8), 4)
    assert_frequencies_match(tokens, expected)


def test_wide_nucleus_frequencies_follow_the_renormalised_nucleus():
    # Nearly flat: the nucleus holds most of the vocabulary, far more than the first
    # top-p candidates, so this goes through the full-sort path.
    vocab_size = 300
    logits = torch.randn(1, vocab_size, generator=torch.Generator().manual_seed(8)) * 0.3
    probs = softmax64(logits[0])
    keep = sorted(nucleus(probs, 0.9))
    assert 200 < len(keep) < vocab_size
    expected = np.zeros(vocab_size)
    expected[keep] = probs[keep] / probs[keep].sum()
    params = SamplingParams(top_p=0.9)
    tokens = draws(Sampler(vocab_size), logits.expand(4000, vocab_size), params, 5)
    assert_frequencies_match(tokens, expected)


def test_top_k_then_top_p_renormalises_over_top_k():
    # top-k 3 leaves probabilities ~ (0.51, 0.31, 0.19): top_p 0.7 keeps the first two,
    # although over the whole vocabulary they hold less than 0.7.
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.9, 0.8, 0.7, 0.6]])
    probs = softmax64(logits[0])
    assert probs[:2].sum() < 0.7
    tokens = draws(Sampler(7), logits.expand(2000, 7), SamplingParams(top_k=3, top_p=0.7), 2)
    assert set(tokens.ravel().tolist()) == {0, 1}


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_samples_only_tokens_above_the_cut(min_p):
    torch.manual_seed(6)
    vocab_size, num_rows = 150, 48
    logits = torch.randn(num_rows, vocab_size) * 2
    params = SamplingParams(min_p=min_p, temperature=0.7)
    tokens = draws(Sampler(vocab_size), logits, params, 30)
    for i in range(num_rows):
        probs = softmax64(logits[i] / 0.7)
        ratio = probs / probs.max()
        assert set(tokens[:, i].tolist()) <= set(
            np.flatnonzero(ratio >= min_p * (1 - 1e-5)).tolist()
        )


# --- logprobs ----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(7)
    vocab_size, padded = 90, 96
    logits = torch.randn(6, padded)
    params = [
        SamplingParams(logprobs=5),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(logprobs=20, top_k=10, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logprobs=3, min_p=0.2, seed=1),
        SamplingParams(logprobs=1, presence_penalty=2.0),
    ]
    rows = [row(p, prompt=[0, 1, 2], output=[3, 3]) for p in params]
    out = Sampler(vocab_size)(logits, rows)
    expected = torch.log_softmax(logits[:, :vocab_size], dim=-1)  # raw: before processing
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(expected[i, token].item(), abs=1e-6)
        assert lp.rank == 1 + int((expected[i] > expected[i, token]).sum())
        top = torch.topk(expected[i], p.logprobs)
        assert list(lp.top_token_ids) == top.indices.tolist()
        assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top_token_ids == ()


# --- interface ---------------------------------------------------------------------------


def test_input_logits_are_not_modified():
    logits = torch.randn(3, 20)
    before = logits.clone()
    rows = [
        row(SamplingParams(repetition_penalty=1.5, temperature=0.0), [1, 2], [3]),
        row(SamplingParams(min_tokens=5, top_p=0.5), [], [1], eos={4}),
        row(SamplingParams(temperature=0.3, top_k=3, min_p=0.1)),
    ]
    Sampler(20)(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("shape", [(2, 20), (3, 19), (3,)])
def test_bad_logits_shape(shape):
    rows = [row(SamplingParams()) for _ in range(3)]
    with pytest.raises(ValueError, match="logits"):
        Sampler(20)(torch.zeros(shape), rows)
