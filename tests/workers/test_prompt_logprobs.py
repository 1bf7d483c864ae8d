"""Prompt logprobs and logit_bias in the engine, against transformers on the same weights.

Prompt logprobs must be the raw model's ``log_softmax`` at every prompt position (the
first prompt token has none) however the prompt is chunked, whether its blocks are in the
prefix cache (such a request takes no hit), beside other requests (whose cost and output
do not change), and on a prefill worker's held delta (a decode worker's request sends
none). ``logit_bias`` adds to the logits before sampling: +100 forces a token, greedy or
sampled, -100 forbids one; the logprobs stay the raw model's.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_engine import write_hf_model
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.wire import TokenEvent, WorkItem, decode_as, encode

K = 3


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, write_hf_model(path, "llama")


def reference(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of one forward over the prompt."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_matches(got, model, prompt: list[int], k: int = K) -> None:
    ref = reference(model, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        lp = got[pos]
        row = ref[pos - 1]
        assert lp.token_id == prompt[pos]
        assert lp.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
        assert lp.rank == int((row > row[prompt[pos]]).sum()) + 1
        values, ids = row.topk(k)
        assert len(lp.top_token_ids) == k
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)
        assert list(lp.top_token_ids) == ids.tolist()


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(vocab_size, (n,), generator=g).tolist() for n in (1, 2, 9, 31, 70)]


def test_prompt_logprobs_are_the_full_forwards_across_chunks(hf_model):
    path, model = hf_model
    # A 24-token budget cuts the longer prompts into chunks (block size 8).
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=24, max_num_seqs=8)
    ps = prompts(model.config.vocab_size)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K)
    outs = llm.generate(ps, params)
    for prompt, out in zip(ps, outs, strict=True):
        assert_matches(out.prompt_logprobs, model, prompt)
    # k = 0: the prompt tokens' own logprobs only.
    zero = llm.generate(ps[3], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert all(lp.top_token_ids == () for lp in zero.prompt_logprobs[1:])
    assert [lp.logprob for lp in zero.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in outs[3].prompt_logprobs[1:]], abs=1e-5
    )
    assert llm.generate(ps[3], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_a_cached_prompt_is_computed_again_and_others_still_hit(hf_model):
    path, model = hf_model
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=24, max_num_seqs=8)
    prompt = prompts(model.config.vocab_size)[4]
    plain = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate(prompt, plain)[0]
    assert llm.generate(prompt, plain)[0].num_cached_tokens > 0  # the blocks are cached
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=K))[0]
    assert out.num_cached_tokens == 0  # no hit: every position's logits were computed
    assert_matches(out.prompt_logprobs, model, prompt)
    assert out.token_ids == first.token_ids
    assert llm.generate(prompt, plain)[0].num_cached_tokens > 0
    llm.engine.block_manager.check_integrity()


def test_beside_other_requests_nothing_else_changes(hf_model):
    path, model = hf_model
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=40, max_num_seqs=8)
    ps = prompts(model.config.vocab_size)
    plain = SamplingParams(max_tokens=6, temperature=0)
    alone = [o.token_ids for o in llm.generate(ps, plain)]
    # Record what each step computes logits of.
    computed: list[tuple[int, int]] = []
    run = llm.engine.runner.run

    def spy(inputs):
        computed.append((len(inputs.sample_indices), len(inputs.prompt_logprob_indices)))
        return run(inputs)

    llm.engine.runner.run = spy
    asked = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1)
    outs = llm.generate(ps, [plain, plain, asked, plain, plain])
    assert [o.token_ids for o in outs] == alone
    assert outs[1].prompt_logprobs is None
    assert_matches(outs[2].prompt_logprobs, model, ps[2], k=1)
    assert sum(p for _, p in computed) == len(ps[2]) - 1  # one row per scored position
    computed.clear()
    llm.generate(ps, plain)
    assert all(p == 0 for _, p in computed)  # others: logits of sampled rows only


def test_with_speculative_decoding_on(hf_model):
    path, model = hf_model
    llm = LLM(str(path), dtype="float32", speculative_method="ngram", speculative_ngram_min=1)
    llm.engine.spec.adaptive = False
    prompt = prompts(model.config.vocab_size)[3] * 2  # repeats: the n-gram proposer proposes
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2))[0]
    assert_matches(out.prompt_logprobs, model, prompt, k=2)


def test_prefill_worker_sends_them_and_the_decode_worker_does_not(hf_model):
    path, model = hf_model
    config = EngineConfig(model=str(path), dtype="float32", block_size=8, detokenize=False)
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prompt = prompts(model.config.vocab_size)[3]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=K)
    rid = prefill.add_request(prompt, params, prefill_only=True)
    deltas = []
    while prefill.has_unfinished_requests():
        deltas += prefill.step()
    (held,) = deltas
    assert held.held_block_ids and held.finish_reason is None
    assert_matches((None, *held.prompt_logprobs), model, prompt)
    decode.add_request(prompt, params, "d", remote_first_token=held.token_ids[0])
    out = decode.step()  # admitted into RECEIVING
    (receive,) = decode.take_kv_receives()
    decode.kv_received("d", ok=False)  # recomputed here: still none to send
    while decode.has_unfinished_requests():
        out += decode.step()
    assert all(d.prompt_logprobs is None for d in out)
    prefill.release_held(rid)
    assert receive.request_id == "d"


def test_logit_bias_forces_and_forbids(hf_model):
    path, model = hf_model
    llm = LLM(str(path), dtype="float32")
    prompt = prompts(model.config.vocab_size)[3]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=1))[0]
    forced_id = (greedy.token_ids[0] + 17) % model.config.vocab_size
    for params in (
        SamplingParams(max_tokens=5, temperature=0, logprobs=0, logit_bias={forced_id: 100}),
        SamplingParams(max_tokens=5, temperature=1.0, seed=7, logit_bias={forced_id: 100.0}),
        SamplingParams(max_tokens=5, temperature=1.0, logit_bias=[(forced_id, 100)]),
    ):
        out = llm.generate(prompt, params)[0]
        assert out.token_ids == (forced_id,) * 5, params
    # Logprobs are the raw model's: the forced token's is what it was without the bias.
    forced = llm.generate(
        prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=1, logit_bias={forced_id: 100})
    )[0]
    raw = reference(model, prompt)[-1]
    assert forced.logprobs[0].logprob == pytest.approx(raw[forced_id].item(), abs=1e-4)
    assert forced.logprobs[0].top_token_ids == (greedy.token_ids[0],)
    # -100 on the greedy token: another one comes first.
    banned = greedy.token_ids[0]
    out = llm.generate(
        prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={banned: -100})
    )[0]
    assert out.token_ids[0] != banned
    assert out.token_ids[0] == int(raw.topk(2).indices[1])
    # A seeded sampled request never draws a token biased by -100 (the greedy one, here).
    for seed in range(5):
        params = SamplingParams(max_tokens=8, temperature=0.5, seed=seed, logit_bias={banned: -100})
        assert banned not in llm.generate(prompt, params)[0].token_ids
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate(prompt, SamplingParams(logit_bias={model.config.vocab_size: 1}))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20]"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be an int"),
        ({"logit_bias": {1: 100.5}}, "logit_bias biases must be in [-100, 100]"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias biases must be in [-100, 100]"),
        ({"logit_bias": {-1: 1}}, "logit_bias token ids must be non-negative"),
        ({"logit_bias": {"1": 1}}, "logit_bias token ids must be ints"),
        ({"logit_bias": {True: 1}}, "logit_bias token ids must be ints"),
        ({"logit_bias": {1: "x"}}, "logit_bias biases must be numbers"),
        ({"logit_bias": [(1, 2), (1, 3)]}, "logit_bias gives token id 1 twice"),
        ({"logit_bias": [(1, 2, 3)]}, "logit_bias must hold (token id, bias) pairs"),
        ({"logit_bias": 5}, "logit_bias must map token ids to biases"),
        ({"logit_bias": {i: 1 for i in range(1025)}}, "logit_bias holds at most 1024 entries"),
    ],
)
def test_sampling_params_refusals_name_the_field(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(needle.split()[0]) and needle in str(info.value)


def test_params_and_events_on_the_wire():
    params = SamplingParams(prompt_logprobs=2, logit_bias={9: -1, 3: 2})
    assert params.logit_bias == ((3, 2.0), (9, -1.0))  # sorted, floats: hashable
    assert hash(params) == hash(SamplingParams(prompt_logprobs=2, logit_bias=[(9, -1), (3, 2)]))
    item = WorkItem("r", (1, 2, 3), params, "full")
    assert decode_as(encode(item), WorkItem) == item
    lp = TokenLogprobs(2, -0.5, 1, (2,), (-0.5,))
    event = TokenEvent("r", (7,), False, prompt_logprobs=(lp, lp))
    assert decode_as(encode(event), TokenEvent) == event
    with pytest.raises(ValueError, match="logit_bias token id 9 is not below"):
        params.validate_for_model(vocab_size=8)
