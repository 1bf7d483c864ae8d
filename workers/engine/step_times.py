"""Where an engine step's time goes, per batch size, for decode-only steps (benchmarks).

Only steps in which every scheduled request computes exactly one token are recorded, so
a prefill chunk never inflates the per-step model time of a batch size. ``execute`` is
the runner's whole call and includes input preparation (``prepare``); the non-model
overhead is schedule + prepare + sample + update.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

STAGES = ("schedule", "prepare", "execute", "sample", "update")


@dataclass
class StepTimes:
    # batch size -> stage -> total seconds (and "steps" -> count), decode-only steps
    by_batch: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    # Told of every step, prefill chunks included: (requests, tokens, seconds per stage)
    # (the layer-wise hand-off's compute numbers: workers/serving/layerwise_stats.py).
    listeners: list[Callable[[int, int, tuple[float, ...]], None]] = field(default_factory=list)

    def add(self, batch: int, num_tokens: int, seconds: tuple[float, ...]) -> None:
        """Record one step: ``seconds`` per stage, in ``STAGES`` order."""
        for listener in self.listeners:
            listener(batch, num_tokens, seconds)
        if num_tokens != batch:
            return  # carries prefill tokens: not a decode step
        row = self.by_batch[batch]
        row["steps"] = row.get("steps", 0) + 1
        for name, value in zip(STAGES, seconds, strict=True):
            row[name] = row.get(name, 0.0) + value

    def overhead_share(self, batch: int) -> dict[str, float]:
        """Mean seconds per stage at this batch size, the model's part and the overhead share."""
        row = self.by_batch.get(batch)
        if not row:
            return {}
        steps = row["steps"]
        mean = {name: row[name] / steps for name in STAGES}
        total = mean["schedule"] + mean["execute"] + mean["sample"] + mean["update"]
        model = mean["execute"] - mean["prepare"]
        return {
            **mean,
            "steps": steps,
            "step": total,
            "model": model,
            "overhead_share": (total - model) / total,
        }

    def reset(self) -> None:
        self.by_batch.clear()
