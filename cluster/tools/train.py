"""``baton train-model``: a small Llama pair (target + draft) that has actually learned text.

Random-weight models cannot show speculative decoding (nothing a random draft proposes is
accepted) nor what quantization costs in accuracy. This trains, on CPU in minutes, a
target Llama on the Python standard library's source (``train_corpus``) and a smaller draft
distilled from it, both with one byte-level BPE tokenizer trained on the same training
files, and writes each as a Hugging Face ``LlamaForCausalLM`` directory (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that
Baton's loader and ``transformers`` both read. Same recipe and seed, same machine and
thread count: the same files. The pair directory also gets ``report.json``: held-out
perplexities and the draft's greedy agreement with the target.

Recipes: ``test`` (a few MB, committed under tests/data/trained) and ``bench`` (a target
big enough that a batch-1 CPU decode step is bound by reading its weights, for the
speculative-decoding benchmark; cached under ~/.cache/baton/trained). ``trained_pair``
is the API the rest of the project calls.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from cluster.tools.families import FAMILIES
from cluster.tools.make_model import _write_json, make_config
from cluster.tools.make_tokenizer import build_tokenizer, generation_config, tokenizer_config
from cluster.tools.train_corpus import eval_windows, stdlib_split, token_stream
from cluster.tools.train_llama import RMS_NORM_EPS, ROPE_THETA, LlamaShape, TrainableLlama
from cluster.tools.train_loop import (
    Schedule,
    distill_draft,
    greedy_acceptance,
    held_out,
    log_to_stderr,
    train_target,
)
from cluster.tools.train_onpolicy import (
    OnPolicy,
    continuation_probe,
    continuation_prompts,
    onpolicy_sequences,
)

FORMAT_VERSION = 1  # bump when a change of this code changes what a recipe produces
TEST_PAIR_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "trained"


@dataclass(frozen=True)
class Recipe:
    """Everything that determines a trained pair (its hash names the cache directory)."""

    name: str
    vocab_size: int
    target: LlamaShape
    draft: LlamaShape
    target_schedule: Schedule
    draft_schedule: Schedule
    max_train_bytes: int | None  # of stdlib source; None: all of it
    eval_tokens: int  # held-out tokens measured
    dtype: str  # of the stored weights
    max_position_embeddings: int = 2048
    seed: int = 0
    num_threads: int = 2  # part of the recipe: float sums differ by thread count
    # The draft is also distilled on the target's own greedy continuations (None: corpus only).
    draft_onpolicy: OnPolicy | None = None

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["draft_onpolicy"] is None:  # recipes from before the field keep their hash
            del fields["draft_onpolicy"]
        return _digest(fields)

    def target_digest(self) -> str:
        """What determines the target alone (not the draft's shape, schedule or data): pairs
        of the same target digest have the same target, so a new draft reuses a cached one."""
        fields = dataclasses.asdict(self)
        del fields["draft"], fields["draft_schedule"], fields["draft_onpolicy"]
        return _digest(fields)


def _digest(recipe_fields: dict) -> str:
    key = {
        "recipe": recipe_fields,
        "format": FORMAT_VERSION,
        # The corpus is this Python's standard library.
        "python": platform.python_version_tuple()[:2],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


RECIPES = {
    # ~1.4M + ~0.3M parameters in float16: about 3.5 MB, committed as test data.
    "test": Recipe(
        name="test",
        vocab_size=2048,
        target=LlamaShape(128, 4, 4, 2, 384),
        draft=LlamaShape(64, 2, 2, 1, 192),
        target_schedule=Schedule(steps=300, lr=3e-3, batch_size=16, seq_len=128),
        draft_schedule=Schedule(steps=150, lr=3e-3, batch_size=16, seq_len=128),
        max_train_bytes=4_000_000,
        eval_tokens=32_768,
        dtype="float16",
    ),
    # Target ~20M parameters (hidden 512, 6 layers), draft ~1.2M: 1/16 of its FLOPs per token.
    "bench": Recipe(
        name="bench",
        vocab_size=2048,
        target=LlamaShape(512, 6, 8, 4, 1408),
        draft=LlamaShape(192, 2, 6, 2, 512),
        target_schedule=Schedule(steps=250, lr=2e-3, batch_size=8, seq_len=256),
        # 400 distillation steps of 4 windows (150 of 8 before): more, cheaper steps (the
        # target's forward, the teacher, is most of a step's cost); the draft's agreement
        # with the target is what speculative decoding's speed-up is made of.
        draft_schedule=Schedule(steps=400, lr=3e-3, batch_size=4, seq_len=256),
        max_train_bytes=None,
        eval_tokens=32_768,
        dtype="float32",
        # 3 of every 4 distillation windows are the target's own greedy continuations of
        # train-split prompts: what the draft is checked against when it speculates.
        draft_onpolicy=OnPolicy(num_sequences=320, fraction=0.75),
    ),
}


def trained_pair(kind: str = "test") -> tuple[Path, Path]:
    """``(target_dir, draft_dir)`` of the ``kind`` ("test" or "bench") trained pair.

    "test" is the committed pair under tests/data/trained when this is a source checkout;
    otherwise (and for "bench") the pair is trained on first use, minutes on CPU, and cached
    under ``$XDG_CACHE_HOME/baton/trained`` (default ~/.cache) by the recipe's hash.
    """
    if kind not in RECIPES:
        raise ValueError(f"unknown pair {kind!r}; choose one of {', '.join(RECIPES)}")
    if kind == "test" and (TEST_PAIR_DIR / "target" / "model.safetensors").is_file():
        return TEST_PAIR_DIR / "target", TEST_PAIR_DIR / "draft"
    recipe = RECIPES[kind]
    pair = cache_root() / f"{recipe.name}-{recipe.digest()}"
    if (pair / "report.json").is_file():
        return pair / "target", pair / "draft"
    pair.parent.mkdir(parents=True, exist_ok=True)
    # One trainer per pair: a second caller waits on the lock, then finds the pair made.
    with open(pair.parent / f"{pair.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (pair / "report.json").is_file():
            for stale in pair.parent.glob(f".{pair.name}-*"):  # a killed trainer's leftovers
                shutil.rmtree(stale, ignore_errors=True)
            # Train into a temporary sibling, then rename: no reader sees half a pair.
            tmp = Path(tempfile.mkdtemp(prefix=f".{pair.name}-", dir=pair.parent))
            try:
                train_pair(recipe, tmp, progress=True, target_from=_cached_target(recipe))
                os.rename(tmp, pair)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return pair / "target", pair / "draft"


def held_out_windows(kind: str, tokenizer: Tokenizer) -> torch.Tensor:
    """Recipe ``kind``'s held-out evaluation windows ([num, seq_len + 1]) encoded with
    ``tokenizer`` (a trained pair's): what the trainer reports its perplexity on, and what
    the benches that score a trained model (quantization, FP8 KV) evaluate."""
    recipe = RECIPES[kind]
    eos_id = tokenizer.token_to_id("<|end_of_text|>")
    if eos_id is None:
        raise ValueError("the tokenizer has no <|end_of_text|> token")

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts)]

    stream = token_stream(encode_batch, stdlib_split(recipe.max_train_bytes).held_out, eos_id)
    return eval_windows(stream, recipe.target_schedule.seq_len, recipe.eval_tokens)


def _cached_target(recipe: Recipe) -> Path | None:
    """The target of a cached pair that ``recipe`` shares its target with (only the draft
    differs), if there is one."""
    for report in sorted(cache_root().glob(f"{recipe.name}-*/report.json")):
        if json.loads(report.read_text()).get("target_digest") == recipe.target_digest():
            return report.parent / "target"
    return None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "baton" / "trained"


def train_pair(
    recipe: Recipe,
    out_dir: str | Path,
    *,
    progress: bool = False,
    target_from: str | Path | None = None,
) -> dict:
    """Train ``recipe``'s pair into ``out_dir``/target and /draft; write and return the
    report (held-out perplexities, agreement, sizes, seconds). ``out_dir`` must be empty.

    ``target_from``: a target directory trained by a recipe of the same
    ``target_digest``; it is copied instead of trained again (training is deterministic,
    so it is the target this recipe would train), and only the draft is trained."""
    out = Path(out_dir)
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    log = log_to_stderr if progress else None
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.num_threads)
    try:
        start = time.perf_counter()
        split = stdlib_split(recipe.max_train_bytes)
        tokenizer = build_tokenizer("llama", recipe.vocab_size, split.train)
        eos_id = FAMILIES["llama"].special_tokens.index(FAMILIES["llama"].eos[0])

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in tokenizer.encode_batch(texts)]

        train_stream = token_stream(encode_batch, split.train, eos_id)
        eval_stream = token_stream(encode_batch, split.held_out, eos_id)
        windows = eval_windows(eval_stream, recipe.target_schedule.seq_len, recipe.eval_tokens)
        if log:
            log(f"corpus: {train_stream.numel()} train / {eval_stream.numel()} held-out tokens")

        target = TrainableLlama(recipe.target, recipe.vocab_size, seed=recipe.seed)
        draft = TrainableLlama(recipe.draft, recipe.vocab_size, seed=recipe.seed + 1)
        untrained = held_out(target, draft, windows)
        if target_from is None:
            train_target(target, train_stream, recipe.target_schedule, recipe.seed, log)
            _round_to(target, recipe.dtype)  # the draft learns (and we measure) what is stored
        else:
            target = load_trainable(target_from)
            if target.shape != recipe.target:
                raise ValueError(f"{target_from} is not this recipe's target ({target.shape})")
            if log:
                log(f"target: reused from {target_from}")
        generated = None
        if recipe.draft_onpolicy is not None:
            generated = onpolicy_sequences(
                target,
                train_stream,
                recipe.draft_onpolicy,
                recipe.draft_schedule.seq_len,
                recipe.seed + 2,
                log,
            )
        distill_draft(
            draft,
            target,
            train_stream,
            recipe.draft_schedule,
            recipe.seed + 1,
            log,
            generated=generated,
            generated_fraction=0.0
            if recipe.draft_onpolicy is None
            else recipe.draft_onpolicy.fraction,
        )
        _round_to(draft, recipe.dtype)
        trained = held_out(target, draft, windows)
        acceptance = greedy_acceptance(target, draft, *acceptance_probe(windows))
        probe_len = min(CONTINUATION_PROMPT_LEN, recipe.target_schedule.seq_len)
        prompts = continuation_prompts(encode_batch(list(split.held_out)), 16, probe_len, 0)
        continuation = continuation_probe(target, draft, prompts, 128, 4)
        seconds = time.perf_counter() - start

        for name, model in (("target", target), ("draft", draft)):
            _write_model(out / name, model, recipe, tokenizer)
        report = {
            "recipe": recipe.name,
            "digest": recipe.digest(),
            "target_digest": recipe.target_digest(),
            "target_reused_from": None if target_from is None else str(target_from),
            "python": platform.python_version(),
            "train_tokens": train_stream.numel(),
            "train_seconds": round(seconds, 1),
            "num_params": {"target": _num_params(target), "draft": _num_params(draft)},
            "held_out": dataclasses.asdict(trained),
            "untrained_held_out": dataclasses.asdict(untrained),
            # Per-token agreement on the target's continuations of held-out FILE STARTS
            # (mostly license headers): higher than what the benchmark sees.
            "greedy_acceptance": acceptance,
            # Like bench/speculative.py's text workload: held-out prompts from random
            # offsets inside files, 128 greedy tokens, 4 proposed per step.
            "continuation_probe": dataclasses.asdict(continuation),
            "onpolicy_sequences": 0 if generated is None else generated.shape[0],
        }
        _write_json(out / "report.json", report)
        return report
    finally:
        torch.set_num_threads(threads)


CONTINUATION_PROMPT_LEN = 256  # bench/speculative.py's text prompts


def acceptance_probe(windows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Prompts and length of the (old) greedy-acceptance measurement: 8 held-out prompts of
    64 tokens, 64 tokens generated by the target after each. The first windows of the
    held-out stream, so mostly file starts: ``continuation_probe`` is the honest one."""
    return windows[:8, :64], 64


def hf_config(recipe: Recipe, shape: LlamaShape) -> dict:
    """config.json of one model of ``recipe``: make-model's llama config, resized, plain RoPE."""
    config = make_config("llama", "tiny", dtype=recipe.dtype)
    config |= {
        "head_dim": shape.head_dim,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": recipe.max_position_embeddings,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "vocab_size": recipe.vocab_size,
    }
    return dict(sorted(config.items()))


def load_trainable(model_dir: str | Path) -> TrainableLlama:
    """A written model back as a float32 ``TrainableLlama`` (for measurements)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = LlamaShape(
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["intermediate_size"],
    )
    model = TrainableLlama(shape, config["vocab_size"], seed=0)
    weights = load_file(Path(model_dir) / "model.safetensors")
    model.load_state_dict({name: t.float() for name, t in weights.items()})
    return model.eval()


def _write_model(out: Path, model: TrainableLlama, recipe: Recipe, tokenizer: Tokenizer) -> None:
    out.mkdir(parents=True)
    config = hf_config(recipe, model.shape)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(tokenizer, FAMILIES["llama"], config)
    )
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(config, FAMILIES["llama"]))
    dtype = getattr(torch, recipe.dtype)
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _round_to(model: TrainableLlama, dtype: str) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(getattr(torch, dtype)).float())


def _num_params(model: TrainableLlama) -> int:
    return sum(p.numel() for p in model.parameters())
