"""Resuming a request from its output so far (``prior_output_token_ids``, request migration).

A request generates N tokens undisturbed; another engine (its own KV cache, as after a
worker died) is given the prompt and the first m of them and must produce exactly the
rest: the same tokens with seeded sampling and penalties (the generator advanced past the
draws, the prior tokens counted as output), and the rest of the text, a stop string that
spans the boundary included, without repeating text already released.
"""

from __future__ import annotations

import pytest

from cluster.tools.make_model import make_model
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.protocol.sampling_params import SamplingParams

PROMPT = "Once upon a time in a land far away there lived"
SEEDED = dict(
    max_tokens=24,
    temperature=0.9,
    top_k=40,
    seed=11,
    ignore_eos=True,
    repetition_penalty=1.3,
    presence_penalty=0.4,
    frequency_penalty=0.3,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume")
    make_model(path, "llama", "tiny", overwrite=True)
    return str(path)


@pytest.fixture(scope="module")
def engines(model_dir):
    """Two engines with separate KV caches: the one that 'died' and the one that resumes."""

    def make() -> LLMEngine:
        config = EngineConfig(
            model=model_dir, dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=128
        )
        return LLMEngine(config)

    return make(), make()


def run(engine: LLMEngine, params: SamplingParams, rid: str, prior=()):
    """Every (token_ids, text) delta of one request to its end, and its final delta."""
    engine.add_request(PROMPT, params, rid, prior_output_token_ids=prior)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas.append((delta.token_ids, delta.text))
            if delta.finished:
                final = delta
    assert engine.block_manager.num_used_blocks == 0
    return deltas, final


def split(deltas, m: int):
    """The tokens of the first m deltas (one token each) and the text they released."""
    tokens = [t for ids, _ in deltas[:m] for t in ids]
    return tokens, "".join(text for _, text in deltas[:m])


@pytest.mark.parametrize("m", [1, 9])
def test_seeded_sampling_with_penalties_continues_token_for_token(engines, m):
    first, second = engines
    params = SamplingParams(**SEEDED)
    ref, ref_final = run(first, params, f"ref-{m}")
    prior, released = split(ref, m)
    rest, final = run(second, params, f"resumed-{m}", prior)
    ref_tokens = [t for ids, _ in ref for t in ids]
    assert len(ref_tokens) == 24 and len(set(ref_tokens)) > 3  # sampled, not one token
    assert prior + [t for ids, _ in rest for t in ids] == ref_tokens
    assert released + "".join(text for _, text in rest) == "".join(text for _, text in ref)
    assert final.finish_reason == ref_final.finish_reason  # max_tokens counted the prior ones


def test_a_stop_string_across_the_boundary_still_matches(engines):
    first, second = engines
    greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = run(first, SamplingParams(**greedy), "plain")
    texts = [text for _, text in plain]
    # A stop string that starts in token j-1's text and ends in token j's, its first match.
    full = "".join(texts)

    def boundary_stop(j: int) -> str | None:
        if not (texts[j - 1] and texts[j]):
            return None
        stop = texts[j - 1][-1] + texts[j][0]
        first = full.find(stop) == len("".join(texts[:j])) - 1
        return stop if first and "\ufffd" not in stop else None

    stop = next(s for j in range(4, len(texts)) if (s := boundary_stop(j)))
    stopped = SamplingParams(**greedy, stop=[stop])
    ref, ref_final = run(first, stopped, "stopped")
    assert ref_final.stop_reason == stop
    ref_tokens = [t for ids, _ in ref for t in ids]
    # Resume with every token before the one that completes the stop string.
    prior, released = split(ref, len(ref_tokens) - 1)
    rest, final = run(second, stopped, "resumed-stop", prior)
    assert prior + [t for ids, _ in rest for t in ids] == ref_tokens
    assert released + "".join(text for _, text in rest) == "".join(text for _, text in ref)
    assert (final.finish_reason, final.stop_reason) == (ref_final.finish_reason, stop)


def test_prior_tokens_that_already_end_the_request_are_refused(engines):
    _, second = engines
    with pytest.raises(ValueError, match=r"prior_output_token_ids: token \d+ already ends"):
        second.add_request(
            PROMPT, SamplingParams(max_tokens=2), "ended", prior_output_token_ids=[5, 6]
        )
    with pytest.raises(ValueError, match="out of vocabulary"):
        second.add_request(PROMPT, SamplingParams(), "bad", prior_output_token_ids=[10**9])
    assert not second.has_unfinished_requests()
