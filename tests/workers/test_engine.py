"""The whole engine against Hugging Face transformers, and its behaviour at the edges.

Models: `make_model` writes the directory (config + a real tokenizer), then transformers
itself re-initialises the weights with a wide spread and saves them over it, so the
reference and the engine read the very same checkpoint.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from cluster.tools.make_model import make_model
from workers import LLM, SamplingParams
from workers.engine.request import FinishReason

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW = 32


def write_hf_model(path, arch: str) -> torch.nn.Module:
    make_model(path, arch, "tiny", overwrite=True)
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.15)
    model.save_pretrained(path)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    out: list[int] = []
    past = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_new):
            step = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module", params=ARCHS)
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_hf_model(path, request.param)


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(vocab_size) for _ in range(40)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in (3, 9, 17, 33, 70)]
    prompts += [shared + [rng.randrange(vocab_size) for _ in range(n)] for n in (5, 12)]
    return prompts


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert not llm.engine.scheduler.requests


def test_greedy_matches_transformers_with_chunking_and_prefix_hits(hf_model):
    path, model = hf_model
    # A 24-token budget splits the long prompts into chunks; block size 8.
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=24, max_num_seqs=8)
    prompts = make_prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    # The reference must not be degenerate (one token repeated would match trivially).
    assert all(len(set(want)) > 4 for want in expected)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=2)

    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)  # every prompt's full blocks are now cached
    for run in (first, second):
        for out, want in zip(run, expected, strict=True):
            assert list(out.token_ids) == want
            assert out.finish_reason is FinishReason.LENGTH
    assert sum(o.num_cached_tokens for o in first) > 0  # the shared 40-token prefix hit
    assert all(
        o.num_cached_tokens == 8 * ((len(p) - 1) // 8) for o, p in zip(second, prompts, strict=True)
    )
    assert_no_leak(llm)

    # Logprobs of the first generated token equal transformers' log-softmax.
    with torch.no_grad():
        for out, prompt in zip(first, prompts, strict=True):
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
            lp = out.logprobs[0]
            assert lp.token_id == out.token_ids[0] and lp.rank == 1
            assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-4
            assert list(lp.top_token_ids) == ref.topk(2).indices.tolist()


def test_preemption_recomputes_to_the_same_tokens(tmp_path):
    model = write_hf_model(tmp_path, "llama")
    prompts = make_prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    # 20 blocks of 8 = 160 slots for 7 requests of up to 102 tokens: preemption must happen.
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=20, max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [list(o.token_ids) for o in outs] == expected
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=32, max_num_seqs=16)


def test_seeded_sampling_is_independent_of_batch_neighbours(tiny_llm):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    other = SamplingParams(max_tokens=7, temperature=1.3, ignore_eos=True)
    alone = tiny_llm.generate(["The weather today"], seeded)[0]
    batch = tiny_llm.generate(
        ["x y z", "The weather today", "a much longer prompt " * 5],
        [other, seeded, other],
    )[1]
    assert alone.token_ids == batch.token_ids
    unseeded = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    a, b = tiny_llm.generate(["The weather today"] * 2, unseeded)
    assert a.token_ids != b.token_ids
    assert_no_leak(tiny_llm)


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_llm):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = tiny_llm.generate(["count with me"], greedy)[0]
    stop_id = base.token_ids[3]
    first_hit = base.token_ids.index(stop_id)
    out = tiny_llm.generate(
        ["count with me"],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0]
    assert out.token_ids == base.token_ids[: first_hit + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop_id
    # min_tokens suppresses the stop token, so the output must differ or be longer.
    out = tiny_llm.generate(
        ["count with me"],
        SamplingParams(
            max_tokens=12,
            min_tokens=first_hit + 2,
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=[stop_id],
        ),
    )[0]
    assert len(out.token_ids) >= first_hit + 2
    assert stop_id not in out.token_ids[: first_hit + 1]
    assert base.finish_reason is FinishReason.LENGTH and len(base.token_ids) == 12


def test_stop_string_is_not_emitted_and_ends_the_request(tiny_llm):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = tiny_llm.generate(["tell me a story"], greedy)[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    assert stop.strip(), "pick a visible stop string"
    out = tiny_llm.generate(
        ["tell me a story"],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]),
    )[0]
    assert out.text == base.text[: base.text.index(stop)]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert len(out.token_ids) < len(base.token_ids)


def test_stop_string_waits_for_min_tokens(tiny_llm):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = tiny_llm.generate(["tell me a story"], greedy)[0]
    stop = base.text[3:6]
    out = tiny_llm.generate(
        ["tell me a story"],
        SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]),
    )[0]
    assert out.text == base.text and out.finish_reason is FinishReason.LENGTH


def test_stream_deltas_concatenate_and_break_aborts(tiny_llm):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    whole = tiny_llm.generate(["streaming test"], params)[0]
    deltas = list(tiny_llm.stream("streaming test", params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert tuple(t for d in deltas for t in d.token_ids) == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    for i, _ in enumerate(tiny_llm.stream("streaming test", params)):
        if i == 3:
            break
    assert_no_leak(tiny_llm)


def test_abort_between_steps_releases_blocks(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request("long prompt " * 8, params) for _ in range(3)]
    engine.step()
    engine.step()
    engine.abort_request(ids[:2])
    finals = {d.request_id: d for d in engine.step() if d.finished}
    assert {finals[i].finish_reason for i in ids[:2]} == {FinishReason.ABORT}
    engine.abort_request(ids[2])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(tiny_llm)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ([0, 10**9], {}, "vocabulary"),
        ([], {}, "empty"),
        ("word " * 5000, {}, "max_model_len"),
        ("hi", {"stop_token_ids": [10**9]}, "stop_token_ids"),
    ],
)
def test_bad_input_is_a_clear_value_error(tiny_llm, prompt, kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny_llm.generate([prompt], SamplingParams(**kwargs))
    assert_no_leak(tiny_llm)  # and the engine still works:
    assert len(tiny_llm.generate(["hi"], SamplingParams(max_tokens=2))[0].token_ids) >= 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"dtype": "float8"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 10**7}, "max_model_len"),
        ({"num_kv_blocks": 1}, "max_model_len"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_engine_config_is_a_clear_value_error(tiny_llm, kwargs, field):
    model_dir = tiny_llm.engine.config.model
    with pytest.raises(ValueError, match=field):
        LLM(model_dir, **kwargs)


def test_a_failing_step_loses_nothing(tiny_llm):
    """The model raising mid-step: no request advances, aborted finals are kept, and the
    engine carries on from the same state once the fault is gone."""
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = tiny_llm.generate(["a retry"], params)[0].token_ids
    victim = engine.add_request("to be aborted", params)
    survivor = engine.add_request("a retry", params)
    engine.abort_request(victim)
    real_run = engine.runner.run

    def broken(*args, **kwargs):
        raise RuntimeError("device fault")

    engine.runner.run = broken
    try:
        with pytest.raises(RuntimeError, match="device fault"):
            engine.step()
    finally:
        engine.runner.run = real_run
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    finals = {d.request_id: d for d in deltas if d.finished}
    assert finals[victim].finish_reason is FinishReason.ABORT
    got = tuple(t for d in deltas if d.request_id == survivor for t in d.token_ids)
    assert got == want
    assert_no_leak(tiny_llm)
