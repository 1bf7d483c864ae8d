"""On-policy distillation data, and the acceptance probe that is measured like the benchmark.

Speculative decoding accepts a draft token when it is the target's greedy token *on the text
the target itself is generating*, not on human-written text. A draft distilled only on
corpus windows learns the target where the text goes, and is weaker where the target's own
continuations go (they repeat, settle into idioms, drift from the corpus). So, as
DistillSpec (Zhou et al., 2023) and EAGLE do, the draft is also distilled on sequences the
trained target generated greedily from prompts of the TRAIN split (``onpolicy_sequences``;
held-out text is never a prompt). ``continuation_probe`` measures the draft the way
bench/speculative.py does: greedy continuations of held-out prompts taken at random offsets
inside files (the old probe's prompts were file starts, mostly license headers, which
overstated acceptance).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.tools.train_llama import TrainableLlama


@dataclass(frozen=True)
class OnPolicy:
    """The draft's on-policy data: ``num_sequences`` target continuations of ``seq_len + 1``
    tokens (the draft schedule's window) each, a prompt of ``prompt_len`` (a range, drawn per
    generation batch) then greedy tokens; ``fraction`` of every distillation batch's windows
    are drawn from them, the rest from the corpus."""

    num_sequences: int
    fraction: float
    prompt_len: tuple[int, int] = (32, 128)
    generation_batch: int = 32


@dataclass(frozen=True)
class ContinuationProbe:
    """The draft against the target's greedy continuations of held-out prompts."""

    num_prompts: int
    prompt_len: int
    num_new: int
    num_tokens: int  # proposed k at a time
    token_agreement: float  # share of continuation tokens the draft predicts given the prefix
    acceptance_rate: float  # accepted / proposed, k tokens proposed per verify step
    mean_accepted_length: float  # accepted per verify step + 1 (the target's own token)


@torch.no_grad()
def onpolicy_sequences(
    target: TrainableLlama,
    train_stream: torch.Tensor,
    config: OnPolicy,
    seq_len: int,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """``[config.num_sequences, seq_len + 1]``: prompts at seeded random offsets of the
    training token stream, each followed by the target's greedy continuation."""
    low, high = config.prompt_len
    if not 0 < low <= high < seq_len:
        raise ValueError(f"prompt lengths {config.prompt_len} do not fit windows of {seq_len}")
    generator = torch.Generator().manual_seed(seed)
    batches = []
    remaining = config.num_sequences
    # One thread: decoding is many small ops, and two threads on two loaded cores spend
    # their time waiting on each other (measured ~10x slower). Fixed here, so still a
    # function of the seed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        while remaining > 0:
            num = min(config.generation_batch, remaining)
            prompt_len = int(torch.randint(low, high + 1, (1,), generator=generator))
            starts = torch.randint(
                0, train_stream.numel() - prompt_len, (num,), generator=generator
            )
            prompts = torch.stack([train_stream[s : s + prompt_len] for s in starts.tolist()])
            batches.append(target.generate_greedy(prompts, seq_len + 1 - prompt_len))
            remaining -= num
            if log is not None:
                done = config.num_sequences - remaining
                log(f"on-policy: {done}/{config.num_sequences} target continuations")
    finally:
        torch.set_num_threads(threads)
    return torch.cat(batches)


def continuation_prompts(
    file_token_ids: list[list[int]], num: int, prompt_len: int, seed: int
) -> torch.Tensor:
    """``[<= num, prompt_len]`` held-out prompts chosen as bench/speculative.py's ``text``
    workload chooses them (for 256-token prompts): one per file of at least
    ``4 * prompt_len`` tokens, in a seeded random order, from a random offset inside it."""
    rng = random.Random(seed)
    prompts = []
    for ids in rng.sample(file_token_ids, len(file_token_ids)):
        if len(ids) < 4 * prompt_len:
            continue
        start = rng.randrange(0, len(ids) - 2 * prompt_len)
        prompts.append(ids[start : start + prompt_len])
        if len(prompts) == num:
            break
    if not prompts:
        raise ValueError(f"no held-out file has {4 * prompt_len} tokens")
    return torch.tensor(prompts, dtype=torch.int64)


@torch.no_grad()
def continuation_probe(
    target: TrainableLlama,
    draft: TrainableLlama,
    prompts: torch.Tensor,
    num_new: int,
    num_tokens: int,
) -> ContinuationProbe:
    """Greedy speculative decoding with ``num_tokens`` proposals per step, replayed: the
    target's greedy continuation is what any accepted prefix is, so the draft's proposal at
    a position is its argmax given the target's tokens before it, and a step accepts the
    run of leading matches (then the target adds one token of its own)."""
    prompt_len = prompts.shape[1]
    seq = target.generate_greedy(prompts, num_new)
    draft.eval()
    matches = draft(seq[:, :-1])[:, prompt_len - 1 :].argmax(-1) == seq[:, prompt_len:]
    proposed = accepted = steps = 0
    for row in matches.tolist():
        pos = 0
        while pos < num_new:
            k = min(num_tokens, num_new - pos)
            run = 0
            while run < k and row[pos + run]:
                run += 1
            proposed, accepted, steps = proposed + k, accepted + run, steps + 1
            pos += run + 1
    return ContinuationProbe(
        num_prompts=prompts.shape[0],
        prompt_len=prompt_len,
        num_new=num_new,
        num_tokens=num_tokens,
        token_agreement=matches.float().mean().item(),
        acceptance_rate=accepted / proposed,
        mean_accepted_length=accepted / steps + 1,
    )
