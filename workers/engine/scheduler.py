"""Continuous batching with a token budget: decodes and prefill chunks in one step.

The scheduler decides which requests run this step and how many of their tokens
(``num_tokens - num_computed_tokens``, capped by the budget) — it never touches
tensors. Running requests go first, in arrival order; when blocks run out the
most recently admitted running request is preempted (its blocks freed, its
tokens recomputed later, usually mostly from the prefix cache). Waiting requests
are admitted FCFS only in a step without preemption, so a request admitted this
step is never preempted in the same step.

Disaggregated roles differ only at the two ends of a request's life:

- prefill: ``hold`` takes a request whose prompt is computed out of scheduling and hands
  its blocks to the KV hand-off (``workers/engine/handoff.py``), which frees them once the
  decode worker has pulled them.
- decode: a request whose prompt was prefilled elsewhere (``is_remote_prefill``) is
  admitted like any other, but gets blocks for its prompt only (sharing the leading ones
  its prefix cache holds: only the rest is received) and waits in RECEIVING
  (counted against ``max_num_seqs``, never scheduled, never preempted) until
  ``finish_receiving`` says the KV arrived; then it decodes like any running request.
  The hand-off tracks it meanwhile and decides when its blocks may be freed.

**Admission** (``workers/engine/admission.py``) gives an admitted request its blocks and
its computed count: the prefix the pool's cache holds is shared and, with **KV tiers**
(``tiers``, docs/kv-tiers.md), the prefix's continuation in the tiers below the pool
(host memory, disk) is onboarded into fresh blocks; both count as computed.

**Slots** (pipeline stages): with ``num_slots > 1`` every request belongs to one slot,
chosen when it is added (the slot with the fewest unfinished requests), and
``schedule(slot)`` considers that slot's requests: its running ones, and its waiting
ones FCFS. The engine keeps one batch per slot in flight. ``max_num_seqs`` counts all
slots together.

**A prompt's chunks overlap in the pipeline**: a request whose prompt still has
unscheduled tokens while one of its chunks is in flight is also drawn by the other
slots (after their own running requests), so a long prompt's next chunk enters the
first stage while the previous one is still in the later stages: its prefill takes
``C + P - 1`` stage times instead of ``C * P`` for ``C`` chunks on ``P`` stages. That
is sound because every stage runs batches in the order they were sent: a chunk's
attention at a stage reads the earlier chunks' KV, which that stage has written by
then. A chunk that samples ends this: the request's next token is not known until that
batch comes back (``num_unscheduled_tokens`` is 0 meanwhile). Tokens in flight count in
``num_scheduled_tokens``, not ``num_computed_tokens``, until their batch comes back
(``update_computed``), and a request with tokens in flight is never preempted (the
pipeline is still writing its KV).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.admission import Admission, NotAdmitted
from workers.engine.block_manager import BlockManager
from workers.engine.handoff import HandoffState, KVHandoff
from workers.engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from workers.engine.kv_tiers.manager import KVTierManager


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request computed this step."""

    request_id: str
    start_pos: int  # num_computed_tokens before the step
    num_tokens: int  # query length this step
    block_ids: tuple[int, ...]  # the request's block table
    needs_sample: bool  # the chunk reaches the request's last known token: sample the next
    # Speculative verify: the chunk's last num_spec tokens are proposals (req.spec_token_ids),
    # and every one of its 1 + num_spec positions is sampled.
    num_spec: int = 0
    # Prompt logprobs (params.prompt_logprobs): the chunk's first num_prompt_logprobs
    # positions get logits too, each scoring the prompt token after it.
    num_prompt_logprobs: int = 0

    @property
    def num_sample_rows(self) -> int:
        """Logits rows this chunk produces."""
        return 1 + self.num_spec if self.needs_sample else 0


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # decodes (one token) first, then longer chunks
    block_copies: tuple[tuple[int, int], ...]  # (src, dst) copy-on-write pairs, before the step
    preempted_ids: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_slots: int = 1,
        handoff: KVHandoff | None = None,
        tiers: KVTierManager | None = None,
    ):
        """``handoff``: the engine's KV hand-off (a private one if None). ``tiers``: the KV
        tiers below the pool, which admission onboards prefix blocks from (None: off)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.handoff = handoff if handoff is not None else KVHandoff(block_manager)
        self.tiers = tiers
        self.admission = Admission(block_manager, self.handoff, tiers)
        self.num_preemptions = 0
        # Told of each request's first scheduling (its queue time and prefix-cache hit are
        # known then); the worker's metrics listen (workers/serving/service.py).
        self.on_first_scheduled: Callable[[Request], None] | None = None

    # ---- requests in and out -----------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if self.num_slots > 1:
            load = [0] * self.num_slots
            for other in self.requests.values():
                load[other.slot] += 1
            req.slot = load.index(min(load))
        if req.num_remote_tokens:  # a remote prefill, or a peer's prefix (G4)
            self.handoff.expect(req.request_id)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request for any reason; frees its blocks. Idempotent.

        Not for a RECEIVING request: a transfer may be writing into its blocks (``abort``
        only marks it; ``finish_receiving`` ends it); the hand-off raises HandoffError.
        """
        if req.is_finished:
            return
        self.handoff.request_ended(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        table = self.block_manager.block_table(req.request_id)
        if not self.handoff.keeps_blocks(req.request_id, table):  # a stream reads them
            self.block_manager.free(req.request_id)
        del self.requests[req.request_id]

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests at any moment between steps; returns those that ended now.

        Unknown ids (held ones included: no longer the scheduler's) are ignored. A
        RECEIVING request is only marked (by the hand-off): its blocks are the target of a
        transfer that may still be writing, so they are freed (and the request returned) by
        ``finish_receiving`` once the transfer has ended.
        """
        aborted = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None or self.handoff.abort(request_id):
                continue
            self.finish(req, FinishReason.ABORT)
            aborted.append(req)
        return aborted

    def hold(self, req: Request) -> None:
        """Prefill role: take a running request out of scheduling but keep its blocks.

        They hold the prompt's KV for a decode worker to pull; from here on the hand-off
        owns them (HELD) and frees them when the pull is done or abandoned.
        """
        req.status = RequestStatus.FINISHED  # finish_reason stays None: it goes on elsewhere
        self.running.remove(req)
        del self.requests[req.request_id]
        self.handoff.hold(req.request_id, self.block_manager.block_table(req.request_id))

    def finish_receiving(self, request_id: str, ok: bool) -> Request:
        """Decode role: the transfer into a RECEIVING request's blocks has ended.

        ``ok``: the prompt's KV is in place (a peer pull: its prefix; the rest is computed
        here next); it counts as computed and its full blocks go into the prefix cache.
        Not ``ok``: the blocks are kept and the prompt is recomputed into them after the
        prefix it was admitted with (from position 0 without one), never into shared
        blocks. Either way the request joins ``running``. If it was aborted meanwhile, it
        is finished (ABORT) now, its blocks freed. Raises ValueError (HandoffError) for a
        request that is not RECEIVING.
        """
        was_aborted = self.handoff.received(request_id)
        req = self.requests[request_id]
        req.status = RequestStatus.RUNNING  # nothing writes into its blocks any more
        if was_aborted:
            self.finish(req, FinishReason.ABORT)
            return req
        if ok:
            req.num_computed_tokens = req.num_remote_tokens
            self.block_manager.commit_computed(
                request_id, req.prompt_token_ids, req.num_remote_tokens, req.cache_root
            )
            if not req.is_remote_prefill:  # a peer's prefix: not computed here either
                req.num_cached_tokens = req.num_remote_tokens
        self.running.append(req)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def receiving(self) -> dict[str, Request]:
        """Decode role: the requests in RECEIVING (their hand-off receiving or aborting)."""
        ids = self.handoff.ids(HandoffState.RECEIVING, HandoffState.ABORTING)
        return {request_id: self.requests[request_id] for request_id in ids}

    # ---- the step ----------------------------------------------------------------
    def schedule(self, slot: int = 0) -> SchedulerOutput:
        """The next batch of ``slot``'s requests (all requests with one slot)."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        bm = self.block_manager
        candidates = self._running_of(slot)

        index = 0
        while index < len(candidates) and budget > 0:
            req = candidates[index]
            if req.spec_token_ids and self._try_verify(req, budget, chunks):
                budget -= chunks[-1].num_tokens
                index += 1
                continue
            req.spec_token_ids = []
            num_new = min(req.num_unscheduled_tokens, budget)
            if not self._make_room(req, num_new, candidates, index, preempted):
                break  # req (and so every candidate after it) waits for blocks
            chunks.append(self._chunk(req, num_new))
            budget -= num_new
            index += 1
        starved = index < len(candidates)

        while (
            not preempted
            and not starved
            and budget > 0
            and len(self.running) + self.handoff.num_receiving < self.max_num_seqs
        ):
            req = self._head_of_queue(slot)
            if req is None:
                break
            if self.handoff.state(req.request_id) is HandoffState.AWAITING:
                if not self._admit_receiving(req):
                    break
                continue
            num_cached = self.admission.allocate(req, budget)
            if isinstance(num_cached, NotAdmitted):  # NO_BLOCKS, or NEXT_STEP
                break  # FCFS: no one overtakes the head of the queue
            assert isinstance(num_cached, int)
            # After any onboarding: fewer blocks may have arrived than found.
            num_new = min(req.num_tokens - num_cached, budget)
            self._admitted(req, num_cached, RequestStatus.RUNNING)
            self.running.append(req)
            chunks.append(self._chunk(req, num_new))
            budget -= num_new

        chunks.sort(key=lambda c: c.num_tokens != 1)  # stable: decodes first
        return SchedulerOutput(tuple(chunks), tuple(bm.take_copies()), tuple(preempted))

    def _try_verify(self, req: Request, budget: int, chunks: list[ScheduledChunk]) -> bool:
        """A decode with proposals: its last token and the proposals in one chunk, if the
        budget and free blocks allow without preempting anyone (else it decodes plainly)."""
        num_new = 1 + len(req.spec_token_ids)
        if req.num_unscheduled_tokens != 1 or num_new > budget:
            return False
        if not self.block_manager.allocate_slots(req.request_id, req.num_scheduled_tokens, num_new):
            return False
        start = req.num_scheduled_tokens
        req.num_in_flight_tokens += num_new
        chunks.append(
            ScheduledChunk(
                request_id=req.request_id,
                start_pos=start,
                num_tokens=num_new,
                block_ids=tuple(self.block_manager.block_table(req.request_id)),
                needs_sample=True,
                num_spec=num_new - 1,
            )
        )
        return True

    def _running_of(self, slot: int) -> list[Request]:
        """The running requests ``slot`` may schedule, in order: its own, then other
        slots' requests whose prompt has a chunk in flight and more to schedule."""
        own = [r for r in self.running if r.slot == slot and r.num_unscheduled_tokens > 0]
        lent = [
            r
            for r in self.running
            if r.slot != slot and r.num_in_flight_tokens > 0 and r.num_unscheduled_tokens > 0
        ]
        return own + lent

    def _make_room(
        self,
        req: Request,
        num_new: int,
        candidates: list[Request],
        index: int,
        preempted: list[str],
    ) -> bool:
        """Allocate ``req``'s blocks for ``num_new`` more tokens, preempting the newest
        candidates after it (then ``req`` itself) while blocks run short. Requests with
        tokens in flight, or whose KV streams out (layer-wise), are never preempted. False: ``req`` got no blocks."""
        while not self.block_manager.allocate_slots(
            req.request_id, req.num_scheduled_tokens, num_new
        ):
            victim = next(
                (
                    r
                    for r in reversed(candidates[index:])
                    if r.num_in_flight_tokens == 0 and not self.handoff.is_streaming(r.request_id)
                ),
                None,
            )
            if victim is None:
                return False
            candidates.remove(victim)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit_receiving(self, req: Request) -> bool:
        """Decode role: admit the head of the queue, whose KV (or a peer's prefix of it)
        comes from another worker, into RECEIVING if blocks allow (False: it waits).
        Its blocks and computed prefix: ``Admission.allocate_receiving``. A peer prefix
        this worker already holds is declined: True without admitting (the caller looks at
        the head of the queue again and admits it as any other request).
        """
        num_cached = self.admission.allocate_receiving(req)
        if num_cached is NotAdmitted.NO_BLOCKS:
            return False
        if num_cached is NotAdmitted.DECLINED:
            return True
        assert isinstance(num_cached, int)
        # The prefix is computed; a failed receive recomputes from here (finish_receiving).
        self._admitted(req, num_cached, RequestStatus.RECEIVING)
        first = num_cached // self.block_manager.block_size
        self.handoff.start_receiving(
            req.request_id, self.block_manager.block_table(req.request_id)[first:], first
        )
        return True

    def _admitted(self, req: Request, num_cached: int, status: RequestStatus) -> None:
        """``req`` leaves the queue with its first ``num_cached`` tokens computed."""
        self.waiting.remove(req)
        if req.first_scheduled_time is None:
            req.num_cached_tokens = num_cached
            self._first_scheduled(req)
        req.num_computed_tokens = num_cached
        req.status = status

    def _head_of_queue(self, slot: int) -> Request | None:
        """The first waiting request of ``slot`` (FCFS within the slot)."""
        if self.num_slots == 1:
            return self.waiting[0] if self.waiting else None
        return next((r for r in self.waiting if r.slot == slot), None)

    def _first_scheduled(self, req: Request) -> None:
        req.first_scheduled_time = time.monotonic()
        if self.on_first_scheduled is not None:
            self.on_first_scheduled(req)

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_scheduled_tokens
        req.num_in_flight_tokens += num_new
        if start < req.num_prompt_tokens:
            req.num_prefill_chunks += 1
        num_prompt_logprobs = 0
        if req.needs_prompt_logprobs:  # positions before the prompt's last score a prompt token
            num_prompt_logprobs = max(0, min(start + num_new, req.num_prompt_tokens - 1) - start)
        return ScheduledChunk(
            request_id=req.request_id,
            start_pos=start,
            num_tokens=num_new,
            block_ids=tuple(self.block_manager.block_table(req.request_id)),
            needs_sample=start + num_new == req.num_tokens,
            num_prompt_logprobs=num_prompt_logprobs,
        )

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.draft_num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_computed(self, chunk: ScheduledChunk) -> Request:
        """After the step ran: advance the request and publish its newly full blocks."""
        req = self.requests[chunk.request_id]
        req.num_in_flight_tokens -= chunk.num_tokens
        req.num_computed_tokens += chunk.num_tokens
        self.block_manager.commit_computed(
            req.request_id, req.token_ids, req.num_computed_tokens, req.cache_root
        )
        return req

    def update_verified(self, chunk: ScheduledChunk, num_accepted: int) -> Request:
        """After a verify chunk ran and ``num_accepted`` proposals were appended to the
        request's tokens (with the target's own token after them): its last token and those
        count as computed; the rejected proposals' slots are rolled back (blocks past the
        request's tokens freed; their KV is overwritten when real tokens get there)."""
        req = self.requests[chunk.request_id]
        req.num_in_flight_tokens -= chunk.num_tokens
        req.num_computed_tokens += 1 + num_accepted
        req.num_spec_proposed += chunk.num_tokens - 1
        req.num_spec_accepted += num_accepted
        req.spec_token_ids = []
        self.block_manager.commit_computed(
            req.request_id, req.token_ids, req.num_computed_tokens, req.cache_root
        )
        self.block_manager.trim(req.request_id, req.num_tokens)
        return req
