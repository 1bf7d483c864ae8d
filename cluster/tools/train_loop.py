"""The optimisation loops of ``baton train-model`` and the held-out measurements.

The target learns the text (next-token cross-entropy); the draft learns the target
(distillation: cross-entropy against the target's full next-token distribution on the same
windows), which is what speculative decoding rewards: a draft token is accepted when it is
what the target would have produced, not when it is what the text says. Every random draw
(initial weights, window offsets) comes from generators seeded by the caller, and the
windows are drawn in a fixed order, so a run is a function of its seed.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.tools.train_corpus import random_windows
from cluster.tools.train_llama import TrainableLlama


@dataclass(frozen=True)
class Schedule:
    """How one model is optimised: AdamW, linear warm-up then cosine decay to 10%."""

    steps: int
    lr: float
    batch_size: int
    seq_len: int
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0


@dataclass(frozen=True)
class HeldOut:
    """Held-out measurements: perplexities and the draft's greedy agreement with the target."""

    num_tokens: int
    target_ppl: float
    draft_ppl: float
    agreement: float  # share of positions where argmax(draft) == argmax(target)


def train_target(
    model: TrainableLlama,
    stream: torch.Tensor,
    schedule: Schedule,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> None:
    """Train ``model`` in place on windows of the token ``stream`` (cross-entropy)."""

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        logits = model(windows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())

    def draw(generator: torch.Generator) -> torch.Tensor:
        return random_windows(stream, schedule.seq_len, schedule.batch_size, generator)

    _optimise(model, draw, schedule, seed, loss_of, "target", log)


def distill_draft(
    draft: TrainableLlama,
    target: TrainableLlama,
    stream: torch.Tensor,
    schedule: Schedule,
    seed: int,
    log: Callable[[str], None] | None = None,
    *,
    generated: torch.Tensor | None = None,
    generated_fraction: float = 0.0,
) -> None:
    """Train ``draft`` in place to match ``target``'s next-token distributions.

    ``generated``: ``[num, seq_len + 1]`` windows of the target's own greedy continuations
    (train_onpolicy); ``round(generated_fraction * batch_size)`` windows of every batch are
    drawn from them, the rest from ``stream``. Without them the draws are the corpus
    windows alone, exactly as before."""
    target.eval()
    num_generated = 0 if generated is None else round(generated_fraction * schedule.batch_size)
    if generated is not None and generated.shape[1] != schedule.seq_len + 1:
        raise ValueError(f"generated windows of {generated.shape[1]} tokens, not seq_len + 1")

    def draw(generator: torch.Generator) -> torch.Tensor:
        num_corpus = schedule.batch_size - num_generated
        parts = []
        if num_corpus:
            parts.append(random_windows(stream, schedule.seq_len, num_corpus, generator))
        if num_generated:
            rows = torch.randint(0, generated.shape[0], (num_generated,), generator=generator)
            parts.append(generated[rows])
        return torch.cat(parts)

    def loss_of(windows: torch.Tensor) -> torch.Tensor:
        inputs = windows[:, :-1]
        with torch.no_grad():
            teacher = F.softmax(target(inputs).flatten(0, 1), dim=-1)
        student = F.log_softmax(draft(inputs).flatten(0, 1), dim=-1)
        return -(teacher * student).sum(-1).mean()

    _optimise(draft, draw, schedule, seed, loss_of, "draft", log)


def _optimise(
    model: TrainableLlama,
    draw: Callable[[torch.Generator], torch.Tensor],
    schedule: Schedule,
    seed: int,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    label: str,
    log: Callable[[str], None] | None,
) -> None:
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": schedule.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=schedule.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr * _lr_factor(step, schedule)
        loss = loss_of(draw(generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
        optimizer.step()
        if log is not None and (step % 25 == 0 or step == schedule.steps - 1):
            elapsed = time.perf_counter() - start
            log(
                f"{label} step {step + 1}/{schedule.steps} loss {loss.item():.3f} ({elapsed:.0f} s)"
            )
    model.eval()


def _lr_factor(step: int, schedule: Schedule) -> float:
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    span = max(1, schedule.steps - schedule.warmup_steps)
    progress = (step - schedule.warmup_steps) / span
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def held_out(target: TrainableLlama, draft: TrainableLlama, windows: torch.Tensor) -> HeldOut:
    """Perplexity of both models and their greedy agreement over held-out ``windows``
    (``[num, seq_len + 1]``; every position but the first of a window is predicted)."""
    target.eval()
    draft.eval()
    nll_target = nll_draft = 0.0
    num_agree = num_tokens = 0
    for chunk in windows.split(8):
        inputs, labels = chunk[:, :-1], chunk[:, 1:].flatten()
        logits_t = target(inputs).flatten(0, 1)
        logits_d = draft(inputs).flatten(0, 1)
        nll_target += F.cross_entropy(logits_t, labels, reduction="sum").item()
        nll_draft += F.cross_entropy(logits_d, labels, reduction="sum").item()
        num_agree += int((logits_t.argmax(-1) == logits_d.argmax(-1)).sum())
        num_tokens += labels.numel()
    return HeldOut(
        num_tokens=num_tokens,
        target_ppl=math.exp(nll_target / num_tokens),
        draft_ppl=math.exp(nll_draft / num_tokens),
        agreement=num_agree / num_tokens,
    )


@torch.no_grad()
def greedy_acceptance(
    target: TrainableLlama, draft: TrainableLlama, prompts: torch.Tensor, num_new: int
) -> float:
    """Share of the target's greedy continuations of ``prompts`` (``[num, prompt_len]``)
    that the draft predicts token for token, given the same prefix: the per-token
    acceptance of greedy speculative decoding (its drafts are checked against exactly this)."""
    target.eval()
    draft.eval()
    seq = prompts
    for _ in range(num_new):  # no KV cache here: recompute, the models are small
        seq = torch.cat([seq, target(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    prompt_len = prompts.shape[1]
    proposed = draft(seq[:, :-1])[:, prompt_len - 1 :].argmax(-1)
    return (proposed == seq[:, prompt_len:]).float().mean().item()


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
