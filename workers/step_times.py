"""Where an engine step's time goes, accumulated per batch size (for benchmarks).

``forward`` includes input preparation (``prepare``) — the runner's whole call;
non-model overhead = schedule + prepare + sample + update.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

STAGES = ("schedule", "prepare", "execute", "sample", "update")


@dataclass
class StepTimes:
    # batch size (number of scheduled requests) -> stage -> [count, total seconds]
    by_batch: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    def add(
        self,
        batch: int,
        schedule: float,
        prepare: float,
        execute: float,
        sample: float,
        update: float,
    ) -> None:
        row = self.by_batch[batch]
        row["steps"] = row.get("steps", 0) + 1
        for name, value in zip(STAGES, (schedule, prepare, execute, sample, update), strict=True):
            row[name] = row.get(name, 0.0) + value

    def overhead_share(self, batch: int) -> dict[str, float]:
        """Mean seconds per stage at this batch size, the model's share and the overhead share."""
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
