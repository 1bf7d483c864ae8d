"""A batch the engine has sent down the pipeline and not yet sampled.

With pipeline stages, rank 0 (the last stage) keeps up to one batch per stage in flight:
while it runs one batch's last layers, the earlier stages already run the next ones
(docs/replicas.md, "Batches in flight"). Without stages there is one, sampled in the
same step that scheduled it. A request aborted while its batch is in flight is gone
from the scheduler when the batch comes back; its logits row is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.model_runner import ModelRunner
from workers.engine.request import Request
from workers.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from workers.engine.step_inputs import StepInputs


@dataclass(frozen=True)
class InFlightBatch:
    slot: int  # the scheduler slot it was drawn from
    sched: SchedulerOutput
    inputs: StepInputs
    requests: tuple[Request, ...]  # one per chunk, as scheduled
    schedule_s: float
    prepare_s: float  # input preparation and the command to the other ranks

    def live(
        self, requests: dict[str, Request], logits: torch.Tensor
    ) -> tuple[list[tuple[ScheduledChunk, Request]], torch.Tensor]:
        """(chunk, request) of the chunks whose request is still scheduled, and the logits
        rows of those that sample (``logits`` has ``chunk.num_sample_rows`` rows per chunk:
        one, or 1 + k for a speculative verify chunk)."""
        live, rows = [], []
        row = 0
        for chunk, req in zip(self.sched.chunks, self.requests, strict=True):
            alive = requests.get(chunk.request_id) is req
            if alive:
                live.append((chunk, req))
                rows.extend(range(row, row + chunk.num_sample_rows))
            row += chunk.num_sample_rows
        if len(rows) == row:
            return live, logits
        return live, logits[torch.tensor(rows, dtype=torch.long)]


class BatchesInFlight:
    """The engine's batches in flight, oldest first: at most one per scheduler slot."""

    def __init__(self) -> None:
        self._batches: deque[InFlightBatch] = deque()
        self._next_slot = 0  # slots take turns, so that each keeps its place in the pipe

    def __len__(self) -> int:
        return len(self._batches)

    def popleft(self) -> InFlightBatch:
        return self._batches.popleft()

    def cancel(self, batch: InFlightBatch, scheduler: Scheduler) -> None:
        """``batch`` (already taken out) failed: it and every batch still in flight are
        dropped, and their requests' tokens count as unscheduled again (a later chunk of a
        prompt needs the KV of the failed one)."""
        for dropped in (batch, *self._batches):
            for chunk, req in zip(dropped.sched.chunks, dropped.requests, strict=True):
                if scheduler.requests.get(chunk.request_id) is req:
                    req.num_in_flight_tokens -= chunk.num_tokens
        self._batches.clear()

    def launch(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        before_prepare: Callable[[SchedulerOutput], None] | None = None,
    ) -> None:
        """Schedule a batch for every free slot and send it down the pipeline.
        ``before_prepare``: called with each batch before its inputs are built (the draft
        model fills in the proposals of its verify chunks there)."""
        busy = {batch.slot for batch in self._batches}
        first, num_slots = self._next_slot, scheduler.num_slots
        for slot in [(first + i) % num_slots for i in range(num_slots)]:
            if slot in busy:
                continue
            t0 = time.perf_counter()
            sched = scheduler.schedule(slot)
            if sched.is_empty:
                continue
            if before_prepare is not None:
                before_prepare(sched)
            t1 = time.perf_counter()
            requests = scheduler.requests
            inputs = runner.launch(sched, requests)
            scheduled = tuple(requests[c.request_id] for c in sched.chunks)
            self._batches.append(
                InFlightBatch(slot, sched, inputs, scheduled, t1 - t0, time.perf_counter() - t1)
            )
            self._next_slot = (slot + 1) % num_slots
