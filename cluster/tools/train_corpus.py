"""Training text for ``baton train-model``: the Python standard library's own source.

Every machine that runs Baton has it, so a trained model can be remade anywhere, offline.
Files are taken in sorted order of their path relative to the stdlib root, test suites and
installed packages left out, and split into train and held-out BY FILE with a hash of that
path: a held-out file is never seen in training (nor by the tokenizer), and a file lands on
the same side under every Python version.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Whole subtrees left out: other projects' code, generated test data, and CPython's test suite
# (large, and full of deliberately odd code).
_EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
HELD_OUT_PERCENT = 10  # about this share of the files is held out


@dataclass(frozen=True)
class CorpusSplit:
    """The selected files' texts, in order: ``train`` for training, ``held_out`` for eval."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_split(max_train_bytes: int | None = None, root: Path | None = None) -> CorpusSplit:
    """The standard library's ``.py`` files as train / held-out texts, deterministic.

    ``max_train_bytes`` caps the training text: files are then taken by the order of a hash
    of their path (a spread over the whole library, not its first letters) until the cap.
    The held-out side is capped at a tenth of it.
    """
    root = root or stdlib_root()
    paths = sorted(
        p
        for p in root.rglob("*.py")
        if p.is_file() and not _EXCLUDED_PARTS.intersection(p.relative_to(root).parts)
    )
    if not paths:
        raise RuntimeError(f"no Python source files under {root}")
    train: list[tuple[int, str]] = []
    held_out: list[tuple[int, str]] = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        digest = zlib.crc32(rel.encode())
        text = path.read_text(encoding="utf-8", errors="replace")
        side = held_out if digest % 100 < HELD_OUT_PERCENT else train
        side.append((digest, text))
    return CorpusSplit(
        train=_take(train, max_train_bytes),
        held_out=_take(held_out, None if max_train_bytes is None else max_train_bytes // 10),
    )


def _take(files: list[tuple[int, str]], max_bytes: int | None) -> tuple[str, ...]:
    if max_bytes is None:
        return tuple(text for _, text in files)
    taken, total = [], 0
    for _, text in sorted(files, key=lambda f: f[0]):  # stable: the list is path-sorted
        if total >= max_bytes:
            break
        taken.append(text)
        total += len(text.encode())
    return tuple(taken)


def token_stream(
    encode_batch: Callable[[list[str]], list[list[int]]], texts: tuple[str, ...], eos_id: int
) -> torch.Tensor:
    """All ``texts`` encoded (``encode_batch``: texts -> id lists, BOS included) and
    concatenated, each followed by ``eos_id``: one long int64 tensor."""
    ids: list[int] = []
    for file_ids in encode_batch(list(texts)):
        ids.extend(file_ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def random_windows(
    stream: torch.Tensor, seq_len: int, batch_size: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` windows of ``seq_len + 1`` tokens at seeded random offsets."""
    if stream.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {stream.numel()} tokens is shorter than seq_len {seq_len}")
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``seq_len + 1`` tokens from the start of
    ``stream``, covering at most ``max_tokens`` tokens."""
    num = min(max_tokens, stream.numel() - 1) // seq_len
    if num == 0:
        raise ValueError(f"held-out text of {stream.numel()} tokens is shorter than {seq_len}")
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(num)])
