"""Speculative decoding in the whole engine: output equal to decoding without it.

Random models: the target (wide random weights), the target itself as its own draft
(every proposal accepted: the accept path, runs of k + 1 tokens per step) and a different
random model of the same tokenizer as the draft (most proposals rejected: the reject and
rollback path). Greedy output must be token for token the same as without speculation,
through batching of mixed requests, chunked prefill, prefix caching, preemption, stop
conditions landing inside an accepted run, and aborts; no KV block may leak.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.tools.make_model import make_model
from cluster.tools.train import trained_pair
from tests.workers import test_engine_roles as roles
from tests.workers.test_engine import assert_no_leak, make_prompts, write_hf_model
from tests.workers.test_speculative_units import chi_square_p_value
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.request import FinishReason, Request
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.engine.speculative.draft import DraftProposer
from workers.models.parallel import ParallelContext

NUM_NEW = 24
BASE = {"dtype": "float32", "block_size": 8, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("target")
    write_hf_model(path, "llama")
    return str(path)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("draft")
    make_model(path, "llama", "tiny", overwrite=True)  # same tokenizer, other weights
    return str(path)


def SpecLLM(model: str, **kwargs) -> LLM:
    """An LLM that speculates at every step it may: the measured gate (its own unit
    test) would turn speculation off where these tiny models make it slower."""
    llm = LLM(model, **kwargs)
    llm.engine.spec.adaptive = False
    return llm


def spec_args(method: str, target: str, other_draft: str) -> dict:
    if method == "ngram":
        return {"speculative_method": "ngram", "speculative_ngram_min": 1}
    draft = target if method == "draft-self" else other_draft
    return {"speculative_method": "draft", "speculative_draft_model": draft}


def general_path(llm: LLM) -> LLM:
    """Make the draft propose through the model runner, as a draft the lean forward does
    not take (another architecture) would."""
    llm.engine.spec.draft.lean = None
    return llm


def mixed_requests(vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = make_prompts(vocab_size)
    prompts.append(prompts[1] * 6)  # repetition for the n-gram lookup
    greedy = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    params = [greedy] * len(prompts)
    params[2] = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    params[3] = SamplingParams(
        max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, speculative=False
    )
    params[4] = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    params[5] = SamplingParams(
        max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, min_tokens=3
    )
    return prompts, params


@pytest.fixture(scope="module")
def reference(target):
    prompts, params = mixed_requests(1024)
    llm = LLM(target, **BASE, max_num_batched_tokens=24)
    return llm.generate(prompts, params)


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_greedy_output_is_unchanged_with_chunking_prefix_hits_and_opt_out(
    target, other_draft, reference, method
):
    prompts, params = mixed_requests(1024)
    # A 24-token budget chunks the long prompts; k + 1 = 5-token verify chunks share it.
    llm = SpecLLM(
        target, **BASE, max_num_batched_tokens=24, **spec_args(method, target, other_draft)
    )
    for _ in range(2):  # the second round hits the prefix cache everywhere
        outs = llm.generate(prompts, params)
        for out, want in zip(outs, reference, strict=True):
            assert out.token_ids == want.token_ids
            assert out.finish_reason == want.finish_reason
            assert out.text == want.text
        for got, want in zip(outs[2].logprobs, reference[2].logprobs, strict=True):
            assert got.token_id == want.token_id and got.rank == want.rank
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert got.top_token_ids == want.top_token_ids
        assert_no_leak(llm)
    stats = llm.engine.spec_stats
    assert stats.num_steps > 0 and stats.num_draft_tokens >= stats.num_steps
    if method == "draft-self":
        assert stats.acceptance_rate == 1.0
        assert stats.mean_accepted_length > 4.0  # k = 4 accepted + the bonus, most steps
    if method == "draft-other":
        assert stats.acceptance_rate < 0.5  # the rejection path is exercised


@pytest.mark.parametrize("method", ["ngram", "draft-other", "draft-other-general"])
def test_preemption_with_speculation_recomputes_to_the_same_tokens(
    target, other_draft, reference, method
):
    prompts, params = mixed_requests(1024)
    # 20 blocks of 8 slots for 8 requests of up to 100+ tokens: preemption must happen.
    llm = SpecLLM(
        target,
        **BASE,
        num_kv_blocks=20,
        max_model_len=160,
        **spec_args(method.removesuffix("-general"), target, other_draft),
    )
    if method.endswith("-general"):
        general_path(llm)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.spec_stats.num_steps > 0
    assert [o.token_ids for o in outs] == [w.token_ids for w in reference]
    assert_no_leak(llm)


def test_stops_inside_an_accepted_run_end_the_request_there(target):
    # Draft == target: every step accepts 4 proposals, so stops land mid-run.
    plain = LLM(target, **BASE)
    spec = SpecLLM(target, **BASE, speculative_method="draft", speculative_draft_model=target)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    base = plain.generate(["a prompt for stopping"], greedy)[0]
    stop_id = base.token_ids[6]
    cases = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[base.text[9:12]]),
        SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True, min_tokens=9, stop_token_ids=[stop_id]
        ),
    ]
    for params in cases:
        want = plain.generate(["a prompt for stopping"], params)[0]
        got = spec.generate(["a prompt for stopping"], params)[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason and got.stop_reason == want.stop_reason
        assert got.finish_reason is FinishReason.STOP or len(got.token_ids) == 7
    deltas = list(spec.stream("a prompt for stopping", greedy))
    assert max(len(d.token_ids) for d in deltas) == 5  # k + 1 tokens in one delta
    assert tuple(t for d in deltas for t in d.token_ids) == base.token_ids
    assert "".join(d.text for d in deltas) == base.text
    assert_no_leak(spec)


def test_aborts_at_any_step_leak_no_block(target):
    llm = SpecLLM(target, **BASE, speculative_method="draft", speculative_draft_model=target)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(1024)
    for abort_after in range(4):
        ids = [engine.add_request(p, params) for p in prompts]
        for _ in range(abort_after):
            engine.step()
        engine.abort_request(ids[::2])
        engine.step()
        engine.block_manager.check_integrity()
        engine.abort_request(ids[1::2])
        while engine.has_unfinished_requests():
            engine.step()
        assert_no_leak(llm)
    assert engine.spec_stats.num_steps > 0


def test_lean_draft_forward_computes_what_the_model_does(target):
    """The draft's proposal-loop forward (draft_forward.py) against the model's own forward
    through the model runner: same logits for rows of different context lengths (several
    blocks, a mask) and for one row alone (no mask)."""
    draft = DraftProposer(target, torch.float32, torch.device("cpu"), 1024, 256)
    draft.bind(num_blocks=16, block_size=8)
    assert draft.lean is not None and draft.runner is not None
    params = SamplingParams(max_tokens=4, temperature=0.0)
    gen = torch.Generator().manual_seed(0)
    lengths, tables = (5, 17, 30), ((0,), (1, 2, 3), (4, 5, 6, 7))
    reqs = {
        f"r{i}": Request(f"r{i}", torch.randint(3, 1024, (n,), generator=gen).tolist(), params,
                         4, frozenset())
        for i, n in enumerate(lengths)
    }  # fmt: skip
    # Every position but the last through the runner, as a prefill.
    prefill = [ScheduledChunk(f"r{i}", 0, n - 1, tables[i], False) for i, n in enumerate(lengths)]
    draft.runner.run(draft.runner.prepare_inputs(SchedulerOutput(tuple(prefill), (), ()), reqs))
    last = [ScheduledChunk(f"r{i}", n - 1, 1, tables[i], True) for i, n in enumerate(lengths)]
    want = draft.runner.run(draft.runner.prepare_inputs(SchedulerOutput(tuple(last), (), ()), reqs))
    ids = torch.tensor([r.token_ids[-1] for r in reqs.values()])
    padded = torch.tensor([[*t, *[0] * (4 - len(t))] for t in tables])
    got = draft.lean.forward(ids, [n - 1 for n in lengths], padded)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    alone = draft.lean.forward(ids[2:], [lengths[2] - 1], padded[2:])
    torch.testing.assert_close(alone, want[2:], rtol=1e-4, atol=1e-4)


def test_large_batches_do_not_speculate(target):
    llm = LLM(target, **BASE, speculative_method="ngram", speculative_max_batch_size=2)
    prompts = [p * 4 for p in make_prompts(1024)[:4]]  # 4 decodes at once
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert llm.engine.spec_stats.num_steps == 0


def test_bad_speculative_settings_are_named():
    with pytest.raises(ValueError, match="speculative_draft_model"):
        LLM("/nonexistent", speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        LLM("/nonexistent", speculative_method="ngram", speculative_ngram_min=5)


def exact_first_tokens(path: str, prompt: list[int], top_k: int, depth: int) -> dict:
    """The target's exact probability of every ``depth``-token continuation under top-k
    sampling at temperature 1, from transformers."""
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == depth:
            out[prefix] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        top = torch.softmax(logits, -1).topk(top_k)
        for p, token in zip(
            (top.values / top.values.sum()).tolist(), top.indices.tolist(), strict=True
        ):
            walk((*prefix, token), prob * p)

    walk((), 1.0)
    return out


@pytest.mark.parametrize(
    "method", [pytest.param("draft-self", marks=pytest.mark.slow), "draft-other"]
)
def test_sampled_output_keeps_the_targets_distribution(target, other_draft, method):
    """Seeded samples of the first 3 tokens against their exact probabilities: the second
    is verified against a proposal (accepted with draft == target, mostly rejected with
    the other draft), the third is the bonus token or decoded after a rejection."""
    prompt, num = [5, 77, 301, 9, 42], 500
    exact = exact_first_tokens(target, prompt, top_k=3, depth=3)
    llm = SpecLLM(
        target, dtype="float32", block_size=8, max_num_seqs=64, max_num_batched_tokens=512,
        speculative_max_batch_size=64, **spec_args(method, target, other_draft),
    )  # fmt: skip
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
        for s in range(num)
    ]
    outs = llm.generate([prompt] * num, params)
    stats = llm.engine.spec_stats
    assert stats.num_steps >= num  # every request verified its second token
    if method == "draft-self":
        assert stats.acceptance_rate == 1.0
    counts = {seq: 0 for seq in exact}
    for out in outs:
        counts[tuple(out.token_ids)] += 1  # KeyError: a token outside the top 3
    # Pearson's chi-square, cells with fewer than 5 expected merged into one.
    small = [s for s in exact if exact[s] * num < 5]
    cells = [([s], exact[s]) for s in exact if s not in small] + [
        (small, sum(exact[s] for s in small))
    ]
    observed = [sum(counts[s] for s in group) for group, _ in cells]
    assert chi_square_p_value(observed, [p for _, p in cells]) > 1e-3, (observed, cells)
    assert_no_leak(llm)


def test_decode_worker_speculates_on_handed_off_requests(target):
    """Decode role: the prompt's target KV arrives from a prefill worker; the draft's is
    computed here from the prompt tokens at the first proposal. Tokens as aggregated."""
    agg, pre = roles.make_engine(target), roles.make_engine(target)
    dec = roles.make_engine(target, speculative_method="draft", speculative_draft_model=target)
    dec.spec.adaptive = False
    prompts = make_prompts(1024)[:5]
    params = [roles.GREEDY] * len(prompts)
    want = [roles.tokens(d) for d in roles.aggregated(agg, prompts, params)]
    held = roles.prefill(pre, prompts, params)
    out = roles.decode(pre, dec, prompts, params, held)
    for h, w in zip(held, want, strict=True):
        assert [h.token_ids[0], *roles.tokens(out[h.request_id])] == w
    assert dec.spec_stats.acceptance_rate == 1.0 and dec.spec_stats.num_steps > 0
    roles.assert_no_blocks_in_use(agg, pre, dec)


@pytest.mark.parametrize("parallel", [{"tp_size": 2}, {"pp_size": 2, "pp_rank": 1}])
def test_parallel_replicas_refuse_speculation_naming_the_setting(parallel):
    config = EngineConfig(model="/nonexistent", speculative_method="ngram")
    with pytest.raises(ValueError, match="speculative_method: ngram is not supported"):
        LLMEngine(config, parallel=ParallelContext(**parallel))


@pytest.fixture(scope="module")
def trained() -> tuple[str, str]:
    target_dir, draft_dir = trained_pair("test")
    return str(target_dir), str(draft_dir)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_trained_pair_accepts_proposals_and_keeps_greedy_output(trained, method):
    """A target and draft that learned Python (tests/data/trained): greedy output as without
    speculation, and a good share of the proposals accepted."""
    target_dir, draft_dir = trained
    source = Path(ast.__file__).read_text()  # Python the pair has seen the like of
    prompts = [source[i : i + 600] for i in (2000, 15000)]
    # Code editing: a function asked for again, for the n-gram lookup to find it.
    prompts.append(source[4000:4600] + "\n\n# The same code again:\n" + source[4000:4060])
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    args = {"dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 256}
    want = LLM(target_dir, **args).generate(prompts, params)
    spec = {"speculative_method": method}
    if method == "draft":
        spec["speculative_draft_model"] = draft_dir
    llm = SpecLLM(target_dir, **args, **spec)  # every step speculates: counts deterministic
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.spec_stats
    # Random weights accept ~nothing; these learned models accept a good share.
    assert stats.acceptance_rate > 0.25, stats
    assert stats.mean_accepted_length > 1.5, stats
    assert_no_leak(llm)
