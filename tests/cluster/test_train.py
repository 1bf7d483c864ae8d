"""The trained model pair (``cluster.tools.train``): the committed test pair has learned
the held-out text, Baton and transformers read it alike, and training is deterministic."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from cluster import cli, cli_models
from cluster.tools import train
from cluster.tools.train import RECIPES, TEST_PAIR_DIR, load_trainable, train_pair, trained_pair
from cluster.tools.train_corpus import eval_windows, stdlib_split, token_stream
from cluster.tools.train_llama import LlamaShape, TrainableLlama
from cluster.tools.train_loop import Schedule, held_out
from cluster.tools.train_onpolicy import (
    OnPolicy,
    continuation_probe,
    continuation_prompts,
    onpolicy_sequences,
)
from workers import LLM, SamplingParams
from workers.text.tokenizer import Tokenizer

NUM_NEW = 24


@pytest.fixture(scope="module")
def pair():
    return trained_pair("test")


@pytest.fixture(scope="module")
def held_out_stream(pair):
    """Held-out stdlib text (files never trained on) in the pair's tokens."""
    tokenizer = Tokenizer.from_dir(pair[0])
    split = stdlib_split(RECIPES["test"].max_train_bytes)
    eos = tokenizer.token_to_id("<|end_of_text|>")
    return token_stream(lambda texts: [tokenizer.encode(t) for t in texts], split.held_out, eos)


def test_committed_pair_is_the_test_pair(pair):
    assert pair == (TEST_PAIR_DIR / "target", TEST_PAIR_DIR / "draft")
    size = sum(p.stat().st_size for d in pair for p in d.iterdir())
    assert size < 8_000_000  # small enough to live in git


def test_target_has_learned_held_out_text(pair, held_out_stream):
    windows = eval_windows(held_out_stream, 128, 8192)
    target, draft = load_trainable(pair[0]), load_trainable(pair[1])
    trained = held_out(target, draft, windows)
    untrained = held_out(
        TrainableLlama(target.shape, target.lm_head.out_features, seed=0),
        TrainableLlama(draft.shape, draft.lm_head.out_features, seed=1),
        windows,
    )
    vocab_size = target.lm_head.out_features
    assert untrained.target_ppl > vocab_size / 2  # an untrained model is near uniform
    assert trained.target_ppl < vocab_size / 10
    assert trained.target_ppl < untrained.target_ppl / 20
    assert trained.draft_ppl < vocab_size / 10
    # The draft proposes what the target would: the premise of speculative decoding.
    assert trained.agreement > 0.5
    assert trained.agreement > 5 * untrained.agreement


@pytest.mark.parametrize("which", [0, 1], ids=["target", "draft"])
def test_baton_and_transformers_agree_on_held_out_text(pair, held_out_stream, which):
    model_dir = pair[which]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "    def __repr__(self):\n        return f'{type(self).__name__}("
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_dir(model_dir).encode(text)

    llm = LLM(str(model_dir), dtype="float32", block_size=16)
    prompts = [held_out_stream[start : start + 40].tolist() for start in (0, 1000, 5000)]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        want = _hf_greedy(hf, prompt, NUM_NEW)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
        assert list(out.token_ids) == want
        assert abs(out.logprobs[0].logprob - float(ref[want[0]])) < 1e-4
    # Trained output is not one token repeated (a random or collapsed model's failure).
    assert len({t for out in outputs for t in out.token_ids}) > 8


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy decoding, step by step over its KV cache (EOS not special)."""
    out: list[int] = []
    past, ids = None, torch.tensor([prompt])
    for _ in range(num_new):
        step = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = step.past_key_values
        out.append(int(step.logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def _mini_recipe(seed: int):
    return dataclasses.replace(
        RECIPES["test"],
        name="mini",
        vocab_size=512,
        target=LlamaShape(64, 2, 4, 2, 128),
        draft=LlamaShape(32, 1, 2, 1, 64),
        target_schedule=Schedule(steps=3, lr=3e-3, batch_size=4, seq_len=32),
        draft_schedule=Schedule(steps=2, lr=3e-3, batch_size=4, seq_len=32),
        max_train_bytes=150_000,
        eval_tokens=256,
        dtype="float32",
        seed=seed,
    )


def test_training_is_deterministic_and_is_a_llama(tmp_path):
    reports = [train_pair(_mini_recipe(0), tmp_path / name) for name in ("a", "b")]
    other = train_pair(_mini_recipe(1), tmp_path / "c")
    for name in ("target", "draft"):
        for file in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (tmp_path / "a" / name / file).read_bytes() == (
                tmp_path / "b" / name / file
            ).read_bytes()
        a = (tmp_path / "a" / name / "model.safetensors").read_bytes()
        assert a != (tmp_path / "c" / name / "model.safetensors").read_bytes()
    assert reports[0]["held_out"] == reports[1]["held_out"] != other["held_out"]

    # The training model computes what transformers' LlamaForCausalLM computes.
    model_dir = tmp_path / "a" / "target"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            load_trainable(model_dir)(ids), hf(ids).logits, rtol=1e-5, atol=1e-5
        )


def test_trained_pair_trains_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(train.RECIPES, "bench", _mini_recipe(0))
    target, draft = trained_pair("bench")
    assert target.parent.parent == tmp_path / "baton" / "trained"
    assert target.parent.name == f"mini-{_mini_recipe(0).digest()}"
    assert (target / "model.safetensors").is_file() and (draft / "tokenizer.json").is_file()
    assert [p.name for p in target.parent.parent.iterdir() if p.name.startswith(".")] == []

    def must_not_train(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(train, "train_pair", must_not_train)
    assert trained_pair("bench") == (target, draft)


def test_a_new_draft_reuses_the_cached_target(tmp_path, monkeypatch):
    """A recipe that changes only the draft trains only the draft: the target is the
    cached pair's (the one training would make again)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = _mini_recipe(0)
    monkeypatch.setitem(train.RECIPES, "bench", first)
    target, draft = trained_pair("bench")
    longer = dataclasses.replace(first, draft_schedule=Schedule(3, 3e-3, 4, 32))
    other_target = dataclasses.replace(first, target_schedule=Schedule(2, 3e-3, 4, 32))
    assert longer.target_digest() == first.target_digest() != other_target.target_digest()
    assert longer.digest() != first.digest()

    def must_not_train(*args, **kwargs):
        raise AssertionError("the target was trained again")

    monkeypatch.setattr(train, "train_target", must_not_train)
    monkeypatch.setitem(train.RECIPES, "bench", longer)
    new_target, new_draft = trained_pair("bench")
    assert new_target.parent.name == f"mini-{longer.digest()}"
    weights = "model.safetensors"
    assert (new_target / weights).read_bytes() == (target / weights).read_bytes()
    assert (new_draft / weights).read_bytes() != (draft / weights).read_bytes()
    report = json.loads((new_target.parent / "report.json").read_text())
    assert report["target_reused_from"] == str(target)
    assert report["target_digest"] == first.target_digest()
    monkeypatch.setitem(train.RECIPES, "bench", other_target)
    with pytest.raises(AssertionError, match="trained again"):
        trained_pair("bench")


def test_train_pair_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        train_pair(_mini_recipe(0), tmp_path)
    with pytest.raises(ValueError, match="unknown pair"):
        trained_pair("huge")


def test_cli_reports_the_committed_pair(capsys):
    assert cli.main(["train-model", "--recipe", "test"]) == 0
    out = capsys.readouterr().out
    report = json.loads((TEST_PAIR_DIR / "report.json").read_text())
    assert f"target {report['held_out']['target_ppl']:.2f}" in out
    assert tuple(RECIPES) == cli_models.TRAIN_RECIPES


def test_onpolicy_sequences_are_the_targets_greedy_continuations_of_train_text():
    """The draft's on-policy windows: a train-split prompt, then what the target says."""
    target = load_trainable(trained_pair("test")[0])
    stream = torch.arange(2000)  # stands in for the train stream: its offsets are visible
    config = OnPolicy(num_sequences=5, fraction=0.5, prompt_len=(8, 16), generation_batch=2)
    seqs = onpolicy_sequences(target, stream, config, seq_len=32, seed=3)
    assert seqs.shape == (5, 33)
    assert torch.equal(seqs, onpolicy_sequences(target, stream, config, seq_len=32, seed=3))
    assert not torch.equal(seqs, onpolicy_sequences(target, stream, config, seq_len=32, seed=4))
    for seq in seqs:
        # The prompt is a run of the stream (consecutive ids here), then greedy tokens.
        prompt_len = next(i for i in range(1, 33) if seq[i] != seq[i - 1] + 1)
        assert 8 <= prompt_len <= 16
        with torch.no_grad():
            want = seq[:prompt_len][None]
            for _ in range(33 - prompt_len):
                want = torch.cat([want, target(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(seq, want[0])


def test_onpolicy_distillation_draws_from_the_train_split_only(tmp_path, monkeypatch):
    """An on-policy recipe prompts the target with training text (never held-out text),
    mixes the continuations into the draft's batches, is deterministic, and reports the
    benchmark-like probe; the target is the one the corpus-only recipe trains."""
    seen: list[torch.Tensor] = []
    real = train.onpolicy_sequences

    def spy(target, stream, *args, **kwargs):
        seen.append(stream)
        return real(target, stream, *args, **kwargs)

    monkeypatch.setattr(train, "onpolicy_sequences", spy)
    recipe = dataclasses.replace(
        _mini_recipe(0), draft_onpolicy=OnPolicy(num_sequences=6, fraction=0.5, prompt_len=(8, 16))
    )
    assert recipe.target_digest() == _mini_recipe(0).target_digest()
    assert recipe.digest() != _mini_recipe(0).digest()
    reports = [train_pair(recipe, tmp_path / name) for name in ("a", "b")]
    plain = train_pair(_mini_recipe(0), tmp_path / "plain")
    split = stdlib_split(recipe.max_train_bytes)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    tokenizer = Tokenizer.from_dir(tmp_path / "a" / "target")
    eos = tokenizer.token_to_id("<|end_of_text|>")
    encode = lambda texts: [tokenizer.encode(t) for t in texts]  # noqa: E731
    assert torch.equal(seen[0], token_stream(encode, split.train, eos))
    weights = "model.safetensors"
    for name in ("a", "b", "plain"):
        assert (tmp_path / name / "target" / weights).read_bytes() == (
            tmp_path / "a" / "target" / weights
        ).read_bytes()
    draft_a = (tmp_path / "a" / "draft" / weights).read_bytes()
    assert draft_a == (tmp_path / "b" / "draft" / weights).read_bytes()
    assert draft_a != (tmp_path / "plain" / "draft" / weights).read_bytes()
    assert reports[0] == reports[1] | {"train_seconds": reports[0]["train_seconds"]}
    assert reports[0]["onpolicy_sequences"] == 6 and plain["onpolicy_sequences"] == 0
    probe = reports[0]["continuation_probe"]
    assert probe["num_new"] == 128 and probe["num_tokens"] == 4 and probe["num_prompts"] >= 1
    assert 1.0 <= probe["mean_accepted_length"] <= 5.0


def test_continuation_probe_replays_greedy_speculation():
    """A draft that is the target accepts every proposal; the probe's prompts come from
    inside files, not their starts."""
    target = load_trainable(trained_pair("test")[0])
    prompts = torch.randint(0, 2048, (3, 16), generator=torch.Generator().manual_seed(0))
    same = continuation_probe(target, target, prompts, num_new=10, num_tokens=4)
    assert same.token_agreement == same.acceptance_rate == 1.0
    # 10 tokens, 4 per step plus the target's own: steps of 5, 5 -> 4 accepted per step.
    assert same.mean_accepted_length == 5.0
    files = [list(range(i * 1000, i * 1000 + 900)) for i in range(4)]
    got = continuation_prompts(files, 3, prompt_len=64, seed=0)
    assert got.shape == (3, 64)
    assert all(row[0] % 1000 + 64 <= 900 - 64 for row in got.tolist())
    assert torch.equal(got, continuation_prompts(files, 3, prompt_len=64, seed=0))
