"""The requests a benchmark sends: token-id prompts and output lengths.

Prompts are token ids drawn at random from the model's vocabulary (minus a few low ids
that tokenizers keep for special tokens), so a prompt's length is exact and does not
depend on the tokenizer. Three sources:

- ``random``: input and output lengths uniform in ``len × [1 - range_ratio, 1 + range_ratio]``.
- ``shared-prefix``: ``num_groups`` groups of requests; every request in a group starts
  with the group's ``prefix_len`` tokens (a long system prompt), then its own suffix.
- ``trace``: a JSONL file of ``{"timestamp": ms, "input_length": n, "output_length": m}``
  (the Mooncake trace format; an optional ``"hash_ids"`` list names the 512-token blocks
  the prompt is made of, so requests that share a block id share those tokens and the
  trace's prefix reuse is reproduced). Arrival times come from the timestamps.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_FIRST_ID = 10  # below: ids that tokenizers often reserve for special tokens
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake-format traces


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float | None = None  # from a trace: seconds after the first request


def random_ids(rng: random.Random, num: int, vocab_size: int) -> tuple[int, ...]:
    """``num`` token ids uniform in ``[_FIRST_ID, vocab_size)``."""
    return tuple(rng.randrange(_FIRST_ID, vocab_size) for _ in range(num))


def random_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in ``mean × [1 - range_ratio, 1 + range_ratio]``, at least 1."""
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio: must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    return [
        BenchRequest(
            random_ids(rng, random_length(rng, input_len, range_ratio), vocab_size),
            random_length(rng, output_len, range_ratio),
        )
        for _ in range(num)
    ]


def shared_prefix_dataset(
    num: int,
    num_groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """Requests round-robin over the groups; ``input_len`` is the suffix after the prefix."""
    if num_groups < 1:
        raise ValueError(f"--num-groups: must be >= 1, got {num_groups}")
    rng = random.Random(seed)
    prefixes = [random_ids(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    return [
        BenchRequest(prefixes[i % num_groups] + random_ids(rng, input_len, vocab_size), output_len)
        for i in range(num)
    ]


def trace_dataset(path: Path, num: int | None, vocab_size: int, seed: int) -> list[BenchRequest]:
    """The first ``num`` requests of a JSONL trace (all when None), in timestamp order."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(
                    (
                        float(row["timestamp"]),
                        int(row["input_length"]),
                        int(row["output_length"]),
                        [int(h) for h in row.get("hash_ids", [])],
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a trace record ({exc!r})") from None
            if rows[-1][1] < 1 or rows[-1][2] < 1:
                raise ValueError(f"{path}:{line_no}: input and output lengths must be >= 1")
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    rows = rows[:num] if num is not None else rows
    rng = random.Random(seed)
    blocks: dict[int, tuple[int, ...]] = {}
    start_ms = rows[0][0]
    out = []
    for timestamp, input_len, output_len, hash_ids in rows:
        prompt: tuple[int, ...] = ()
        for h in hash_ids:
            if h not in blocks:
                blocks[h] = random_ids(random.Random(f"{seed}/{h}"), TRACE_BLOCK_TOKENS, vocab_size)
            prompt += blocks[h]
        prompt = prompt[:input_len] + random_ids(rng, max(0, input_len - len(prompt)), vocab_size)
        out.append(BenchRequest(prompt, output_len, (timestamp - start_ms) / 1000.0))
    return out
