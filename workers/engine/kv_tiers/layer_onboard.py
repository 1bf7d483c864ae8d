"""Layer-wise onboarding: a request's tier hit copied into its pool blocks layer group by
layer group on a thread, while the request's first chunk computes (docs/kv-tiers.md,
"Layer-wise onboarding").

The synchronous path (``KVTierManager.onboard_request``) copies every layer of every hit
block before the step that computes the rest of the prompt. Here admission starts a job
(``start``) and the step's forward pass waits, before each layer, only until that layer's
group has arrived (``hook_for``): the chunk computes layer L while groups after L are read.
The job publishes one monotonic counter, ``layers_ready`` (the layer-wise hand-off's kind of
readiness, docs/kvtransfer.md): layer L of *every* hit block is in the pool once
``layers_ready > L``. A block's bytes are layer-major (``kv_cache[block_id]`` is
``[num_layers, ...]``, FP8 scales and MLA latents included), so a group of a block is one
contiguous byte range: a host-tier slice (``HostTier.get_range``) or a range of the block's
file (``DiskTier.open_ranges``).

Who owns what, and when:

- **A job never outlives the step that admitted its request.** The step waits for the
  last group before its last layer, and ``settle`` (after the forward, before sampling)
  joins it; ``cancel_all`` does the same when the forward raised. Abort, preemption and
  finish happen between steps, so no block is freed, evicted or handed out while a copy
  writes into it, and the scheduler needs no new state.
- **Onboarded blocks enter the prefix cache only once every layer arrived**: admission
  does not commit them (the synchronous path does); the step's ``update_computed``
  commits them with the chunk, after ``settle``.
- **A read that fails** (a host block evicted meanwhile, a file truncated, a payload whose
  checksum, known only after its last range, is wrong) truncates the job at that block:
  later groups copy only the blocks before it. The forward has then used bad KV, so
  ``settle`` drops the request's chunk (its logits row, its in-flight tokens) and sets its
  computed count to the blocks that did arrive: the next step recomputes from the first
  bad block into the blocks it already holds, as the synchronous path computes from the
  first block no tier delivered. A failed block is not retried from a lower tier (the
  synchronous path does that): it is recomputed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtransfer.layerwise import layer_groups
from workers.engine.config import OnboardMode
from workers.engine.kv_tiers.host_tier import HostTier

if TYPE_CHECKING:
    from workers.engine.kv_tiers.block_file import BadBlock, RangeReader
    from workers.engine.kv_tiers.disk_tier import DiskTier
    from workers.engine.kv_tiers.manager import TierHit
    from workers.engine.request import Request
    from workers.engine.scheduler import ScheduledChunk, Scheduler

logger = logging.getLogger(__name__)

# ``auto``: layer-wise when the disk holds a hit block, or the hit is at least this many
# blocks (bench/kv_onboard.py: below it a host-tier copy costs less than the thread's start).
AUTO_MIN_HOST_BLOCKS = 64
NUM_GROUPS = 4  # groups per job: each is one wake-up of the step; 4 hide all but a quarter


@dataclass(eq=False)  # a job is itself: compared and hashed by identity
class OnboardJob:
    """One request's layer-wise onboarding (written by its thread, read by the step)."""

    request_id: str
    block_hashes: tuple[int, ...]
    tier_indexes: tuple[int, ...]
    block_ids: tuple[int, ...]  # the fresh pool blocks, one per hit block
    num_prefix_blocks: int  # the pool's own hit before them
    layers_ready: int = 0  # monotonic: layers of every surviving block now in the pool
    num_blocks: int = 0  # leading blocks that arrive (a failed read truncates it)
    is_done: bool = False
    is_cancelled: bool = False
    published: list[int] = field(default_factory=list)  # each layers_ready, for tests
    seconds: float = 0.0
    start_ns: int = field(default_factory=time.time_ns)  # the request's trace span


class LayerOnboarder:
    def __init__(
        self,
        g1: torch.Tensor,
        num_layers: int,
        lookup: Sequence[HostTier | DiskTier],
        block_size: int,
        mode: OnboardMode = "auto",
        after_group: Callable[[OnboardJob, int], None] | None = None,
    ) -> None:
        """``g1``: the pool as ``[num_blocks, block_bytes]`` uint8 rows; ``lookup``: the
        manager's tiers in lookup order (host or staging first, then disk).
        ``after_group(job, layers)``: called on the job's thread once a group is copied,
        before it is published (tests inject a delay or a failure there)."""
        if g1.shape[1] % num_layers:
            raise ValueError(f"a block of {g1.shape[1]} bytes is not {num_layers} layers")
        self._g1 = g1
        self.num_layers = num_layers
        self._layer_bytes = g1.shape[1] // num_layers
        self._lookup = tuple(lookup)
        self.block_size = block_size
        self.mode: OnboardMode = mode
        self.after_group = after_group
        self._groups = layer_groups(num_layers, max(1, -(-num_layers // NUM_GROUPS)))
        self._stream = torch.cuda.Stream(g1.device) if g1.device.type == "cuda" else None
        self._cond = threading.Condition()
        self.jobs: dict[str, OnboardJob] = {}  # engine thread only: started, not settled
        self.num_onboarded = self.num_failed = 0  # blocks (the manager's stats add them)

    def applies(self, hit: TierHit) -> bool:
        """Whether ``hit`` is onboarded layer-wise (else synchronously, at admission)."""
        if self.mode != "auto":
            return self.mode == "on"
        has_disk = any(not isinstance(self._lookup[i], HostTier) for i in hit.tier_indexes)
        return has_disk or hit.num_blocks >= AUTO_MIN_HOST_BLOCKS

    def is_onboarding(self, hit: TierHit) -> bool:
        """Whether a job of this step onboards ``hit``'s first block (into another
        request's blocks, not yet in the prefix cache): admission then waits a step."""
        return any(hit.block_hashes[0] in job.block_hashes for job in self.jobs.values())

    # ---- engine thread -----------------------------------------------------------------
    def start(self, request_id: str, hit: TierHit, block_ids: Sequence[int], num_prefix: int):
        """Admission: copy ``hit`` into ``block_ids`` on a thread (the request's first chunk
        is scheduled in this step and waits per layer in ``hook_for``)."""
        job = OnboardJob(
            request_id, hit.block_hashes, hit.tier_indexes, tuple(block_ids), num_prefix,
            num_blocks=hit.num_blocks,
        )  # fmt: skip
        self.jobs[request_id] = job
        threading.Thread(target=self._run, args=(job,), name="kv-onboard", daemon=True).start()
        return job

    def hook_for(
        self, requests: Sequence[Request], inner: Callable[[int], None] | None
    ) -> Callable[[int], None] | None:
        """The step's per-layer hook (after layer i): ``inner``, then wait until layer i+1
        of the step's onboarding requests arrived. Waits for layer 0 here, before the
        forward. None (and ``inner``) when no request of the step onboards."""
        jobs = [self.jobs[r.request_id] for r in requests if r.request_id in self.jobs]
        if not jobs:
            return inner
        self._wait(jobs, 1)

        def hook(layer: int) -> None:
            if inner is not None:
                inner(layer)
            if layer + 2 <= self.num_layers:
                self._wait(jobs, layer + 2)

        return hook

    def settle(
        self,
        requests: Sequence[Request],
        live: list[tuple[ScheduledChunk, Request]],
        logits: torch.Tensor,
        scheduler: Scheduler,
    ) -> tuple[list[tuple[ScheduledChunk, Request]], torch.Tensor]:
        """After the forward, before sampling: join the step's jobs; a request whose job
        failed part-way loses its chunk (its row of ``logits`` is dropped) and computes
        from its first missing block next step. ``requests``: the step's, one per chunk
        (one no longer live, aborted meanwhile, has its job joined and counted too).
        Returns the live chunks and their rows."""
        live_ids = {req.request_id for _, req in live}
        self.cancel_all([r for r in requests if r.request_id not in live_ids], scheduler)
        failed: set[str] = set()
        for chunk, req in live:
            job = self.jobs.pop(req.request_id, None)
            if job is None:
                continue
            self._join(job)
            req.onboard_ns = (job.start_ns, time.time_ns())
            if not self._account(job):
                self._roll_back(chunk, req, job, scheduler)
                failed.add(req.request_id)
        if not failed:
            return live, logits
        kept, rows, row = [], [], 0
        for chunk, req in live:
            if req.request_id not in failed:
                kept.append((chunk, req))
                rows.extend(range(row, row + chunk.num_sample_rows))
            row += chunk.num_sample_rows
        return kept, logits[torch.tensor(rows, dtype=torch.long)]

    def cancel_all(self, requests: Sequence[Request], scheduler: Scheduler) -> None:
        """The step raised: stop the jobs of its ``requests`` (the copy in hand finishes),
        and count none of their blocks as computed: the step is retried with the blocks
        they hold, recomputing the hit. Call before ``BatchesInFlight.cancel``."""
        for req in requests:
            job = self.jobs.pop(req.request_id, None)
            if job is None:
                continue
            job.is_cancelled = True
            self._join(job)
            self.num_failed += len(job.block_hashes)
            req.num_computed_tokens = job.num_prefix_blocks * self.block_size
            req.num_onboarded_tokens = 0

    # ---- internals ---------------------------------------------------------------------
    def _wait(self, jobs: list[OnboardJob], num_layers: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: all(j.layers_ready >= num_layers for j in jobs))

    def _join(self, job: OnboardJob) -> None:
        with self._cond:
            self._cond.wait_for(lambda: job.is_done)

    def _account(self, job: OnboardJob) -> bool:
        self.num_onboarded += job.num_blocks
        self.num_failed += len(job.block_hashes) - job.num_blocks
        return job.num_blocks == len(job.block_hashes)

    def _roll_back(
        self, chunk: ScheduledChunk, req: Request, job: OnboardJob, scheduler: Scheduler
    ) -> None:
        req.num_in_flight_tokens -= chunk.num_tokens
        req.num_computed_tokens = (job.num_prefix_blocks + job.num_blocks) * self.block_size
        req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)
        req.num_onboarded_tokens = job.num_blocks * self.block_size
        scheduler.block_manager.commit_computed(
            req.request_id, req.token_ids, req.num_computed_tokens, req.cache_root
        )

    def _run(self, job: OnboardJob) -> None:
        job.seconds = start = time.perf_counter()  # (the start until done)
        readers: list[RangeReader | None] = []
        try:
            if self._stream is not None:  # a stream of its own: copies overlap compute
                torch.cuda.set_stream(self._stream)
            readers = self._open(job)
            for first, end in self._groups:
                if job.is_cancelled:  # the step raised: nothing more is read
                    self._truncate(job, readers, 0)
                    break
                self._copy_group(job, readers, first, end)
                if self.after_group is not None:
                    self.after_group(job, end)
                if end == self.num_layers:
                    self._finish(job, readers)
                self._publish(job, end)
        except Exception:
            job.num_blocks = 0  # none counts as arrived: the step recomputes them
            logger.exception("KV tiers: layer-wise onboarding of %s failed", job.request_id)
        finally:
            for reader in readers:
                if reader is not None:
                    reader.close()
            job.seconds = time.perf_counter() - start
            with self._cond:
                job.is_done = True
                job.layers_ready = self.num_layers  # waiters go on (a failure is settled)
                self._cond.notify_all()

    def _open(self, job: OnboardJob) -> list[RangeReader | None]:
        """Open each hit block's source, in order; the first that fails truncates."""
        readers: list[RangeReader | None] = []
        for i, (block_hash, index) in enumerate(
            zip(job.block_hashes, job.tier_indexes, strict=True)
        ):
            tier = self._lookup[index]
            if isinstance(tier, HostTier):
                readers.append(None)  # read by slices under the tier's lock
                continue
            reader = tier.open_ranges(block_hash)
            if reader is None:
                job.num_blocks = i
                break
            readers.append(reader)
        return readers

    def _copy_group(self, job: OnboardJob, readers: list, first: int, end: int) -> None:
        lo, hi = first * self._layer_bytes, end * self._layer_bytes
        for i in range(job.num_blocks):
            out = self._g1[job.block_ids[i], lo:hi]
            reader = readers[i]
            if reader is None:
                tier = self._lookup[job.tier_indexes[i]]
                ok = tier.get_range(job.block_hashes[i], lo, out)  # type: ignore[union-attr]
            else:
                bad = self._read_file(reader, lo, out)
                ok = bad is None
                if not ok:  # this file is bad: counted and removed, as a failed ``get``
                    readers[i] = None
                    self._disk(job, i).ranges_done(job.block_hashes[i], reader, bad, 0.0)
            if not ok:
                self._truncate(job, readers, i)
                return
        if self._stream is not None:  # published only once in the pool
            self._stream.synchronize()

    def _read_file(self, reader: RangeReader, start: int, out: torch.Tensor) -> BadBlock | None:
        if out.device.type == "cpu":
            return reader.read(start, memoryview(out.numpy()))
        host = torch.empty(out.numel(), dtype=torch.uint8, pin_memory=True)
        bad = reader.read(start, memoryview(host.numpy()))
        if bad is None:
            out.copy_(host)
        return bad

    def _finish(self, job: OnboardJob, readers: list) -> None:
        """Verify each file's payload (known only after its last range), in order."""
        seconds = (time.perf_counter() - job.seconds) / max(1, job.num_blocks)
        for i in range(job.num_blocks):
            reader = readers[i]
            if reader is None:
                continue
            readers[i] = None
            if not self._disk(job, i).ranges_done(job.block_hashes[i], reader, None, seconds):
                self._truncate(job, readers, i)
                return

    def _truncate(self, job: OnboardJob, readers: list, first: int) -> None:
        """Blocks from ``first`` on will not arrive (their files stay: they were not
        found bad, only not needed)."""
        for i in range(first, len(readers)):
            reader, readers[i] = readers[i], None
            if reader is not None:
                reader.close()
        job.num_blocks = min(job.num_blocks, first)

    def _disk(self, job: OnboardJob, index: int) -> DiskTier:
        return self._lookup[job.tier_indexes[index]]  # type: ignore[return-value]

    def _publish(self, job: OnboardJob, num_layers: int) -> None:
        with self._cond:
            job.layers_ready = max(job.layers_ready, num_layers)
            job.published.append(job.layers_ready)
            self._cond.notify_all()
