"""``baton profile``: measure a model's step times on this machine in minutes, for the planner.

The planner (docs/planner.md) sizes pools from fits of each pool's step time. Without a
profile it learns them online and holds its first decisions until the workers have served
enough steps; Dynamo's planner instead needs a profiling sweep that takes hours of GPU
time. Here one engine of each pool's settings runs a small grid of real steps and the
records go to a file (``cluster/planner/profile.py``) that ``planner.profile`` seeds the
fits with; serving refines them.

The grid, sized by the engine's limits so it fits its KV cache:

- prefill: single prompts of 16, 32, 64, ... tokens up to the longest that fits (at most
  ``max_prompt``), each timed from ``add_request`` to its first token (every chunk of it),
  as the planner's feed times a prompt;
- decode: batches of 1, 2, 4, ... sequences up to ``max_num_seqs`` at contexts of 64, 512
  and 2048 tokens (those that fit, and whose prompts cost at most ``max_setup_tokens`` to
  prefill), each batch prefilled once, one step run untimed, then ``repeats x
  decode_steps`` single steps timed (the contexts grow by those few tokens).

Each prompt length is run once untimed first (kernels picked, weights packed, the
allocator warmed), then ``repeats`` times. Prompts are random token ids from a seeded generator, so
no prompt hits another's prefix cache.
"""

from __future__ import annotations

import datetime
import gc
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.planner.profile import PROFILE_VERSION, ProfiledDecode, ProfiledPrefill, StepProfile
from workers.engine.config import EngineConfig

logger = logging.getLogger(__name__)

_CONTEXTS = (64, 512, 2048)
_SHAPING = (  # the engine settings a step's time depends on, recorded with the profile
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "attention_backend",
)


@dataclass(frozen=True)
class Grid:
    repeats: int = 3
    decode_steps: int = 4
    max_prompt: int = 2048
    max_setup_tokens: int = 8192  # prompt tokens one decode point may prefill
    max_batch: int = 64


def prefill_lengths(longest: int, grid: Grid) -> list[int]:
    lengths, n = [], 16
    while n <= min(longest, grid.max_prompt):
        lengths.append(n)
        n *= 2
    return lengths


def decode_points(
    longest: int, capacity_tokens: int, max_seqs: int, budget: int, grid: Grid
) -> list[tuple[int, int]]:
    """(batch, context) pairs that fit: every sequence's context, the tokens it decodes
    while the others are still prefilling (``budget`` prompt tokens a step), the timed
    steps and one untimed in the KV cache; and the prompts' prefill within
    ``max_setup_tokens``."""
    steps = grid.repeats * grid.decode_steps + 2
    points = []
    batch = 1
    while batch <= min(max_seqs, grid.max_batch):
        for context in _CONTEXTS:
            grown = context + -(-batch * context // budget) + steps
            if (
                grown <= longest
                and batch * grown <= capacity_tokens
                and batch * context <= grid.max_setup_tokens
            ):
                points.append((batch, context))
        batch *= 2
    return points


class _Runner:
    """One engine and the seeded prompts fed to it."""

    def __init__(self, engine, seed: int) -> None:
        from workers import SamplingParams

        self.engine = engine
        self.rng = random.Random(seed)
        vocab = engine.vocab_size
        # Skip the low ids, where tokenizers keep their special tokens.
        self.ids = range(min(256, vocab // 4), vocab - 1)
        self.params = SamplingParams
        self.count = 0

    def prompt(self, length: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(length)]

    def add(self, length: int, max_tokens: int) -> str:
        self.count += 1
        request_id = f"profile-{self.count}"
        params = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(self.prompt(length), params, request_id)
        return request_id

    def prefill_seconds(self, length: int) -> float:
        """One prompt from its arrival to its first token."""
        started = time.perf_counter()
        self.add(length, 1)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return time.perf_counter() - started

    def decode_steps(self, batch: int, context: int, steps: int) -> list[tuple[int, float]]:
        """Prefill ``batch`` prompts of ``context`` tokens, run one decode step untimed,
        then time ``steps`` decode steps; returns (KV tokens summed, seconds) per step.
        Every request is aborted at the end."""
        max_tokens = self.engine.max_model_len - context  # never the one that stops it
        ids = [self.add(context, max_tokens) for _ in range(batch)]
        produced = dict.fromkeys(ids, 0)
        while min(produced.values()) < 2:  # every one prefilled and decoded once
            for delta in self.engine.step():
                produced[delta.request_id] += len(delta.token_ids)
        out = []
        for _ in range(steps):
            kv_tokens = sum(context + n for n in produced.values())
            started = time.perf_counter()
            deltas = self.engine.step()
            seconds = time.perf_counter() - started
            got = sum(1 for d in deltas if d.token_ids)
            if got != batch:  # a step that was not one decode step of the whole batch
                raise RuntimeError(f"decode step gave {got} tokens for a batch of {batch}")
            for delta in deltas:
                produced[delta.request_id] += len(delta.token_ids)
            out.append((kv_tokens, seconds))
        self.engine.abort_request(ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return out


def _measure_prefill(runner: _Runner, grid: Grid, longest: int, say) -> list[ProfiledPrefill]:
    records = []
    for length in prefill_lengths(longest, grid):
        runner.prefill_seconds(length)  # untimed
        times = [runner.prefill_seconds(length) for _ in range(grid.repeats)]
        say(f"prefill {length:5d} tokens: {sorted(times)[len(times) // 2] * 1e3:8.1f} ms")
        records += [ProfiledPrefill(length, length * length / 1000.0, t) for t in times]
    return records


def _measure_decode(runner: _Runner, grid: Grid, longest: int, say) -> list[ProfiledDecode]:
    engine = runner.engine
    config = engine.config
    capacity = engine.block_manager.num_free_blocks * config.block_size
    budget = config.max_num_batched_tokens
    records = []
    for batch, context in decode_points(longest, capacity, config.max_num_seqs, budget, grid):
        # One prefill per point: its first step is dropped (warm-up), the rest timed.
        steps = runner.decode_steps(batch, context, 1 + grid.repeats * grid.decode_steps)[1:]
        median = sorted(t for _, t in steps)[len(steps) // 2]
        say(f"decode batch {batch:3d} x context {context:5d}: {median * 1e3:8.1f} ms/step")
        records += [ProfiledDecode(batch, kv, t) for kv, t in steps]
    return records


def run_profile(
    prefill: EngineConfig,
    decode: EngineConfig,
    model_name: str,
    threads: int,
    grid: Grid = Grid(),
    say: Callable[[str], None] = print,
    seed: int = 0,
) -> StepProfile:
    """Measure ``prefill``'s prompts and ``decode``'s steps (one engine if the settings
    are equal); every request is aborted or finished and no block stays in use."""
    import torch

    from workers.engine.llm_engine import LLMEngine

    if threads > 0 and prefill.device == "cpu":
        torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = LLMEngine(prefill)
    runner = _Runner(engine, seed)
    longest = engine.max_model_len - 2
    say(f"prefill pool's engine: max_model_len {engine.max_model_len}")
    prefill_records = _measure_prefill(runner, grid, longest, say)
    if decode != prefill:
        del runner, engine
        gc.collect()
        engine = LLMEngine(decode)
        runner = _Runner(engine, seed + 1)
        longest = engine.max_model_len - 2
    decode_records = _measure_decode(runner, grid, longest, say)
    if engine.block_manager.num_used_blocks or engine.has_unfinished_requests():
        raise RuntimeError("the profile left requests or blocks in the engine")
    return StepProfile(
        version=PROFILE_VERSION,
        model=model_name,
        device=decode.device,
        threads=threads,
        engine={
            **{key: _plain(getattr(decode, key, None)) for key in _SHAPING},
            "dtype": str(engine.dtype).removeprefix("torch."),  # "auto" resolved
            "max_model_len": engine.max_model_len,
        },
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - started, 3),
        prefill=prefill_records,
        decode=decode_records,
    )


def _plain(value):
    return value if value is None or isinstance(value, int | float | str | bool) else str(value)
