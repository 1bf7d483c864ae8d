"""Peer pull (G4): a worker that lacks a prefix another worker holds pulls it over NIXL.

When the router is about to send a request to the worker that will compute its prompt
(B: the prefill worker, or a decode worker prefilling itself), and another worker (A, of
either pool) holds a longer prefix of the prompt in its cache, by at least
``peer_min_blocks`` blocks (the hash sets every worker reports), the router first asks A
to *export* that prefix: A admits the prefix's tokens plus one as a prefill-role request
(its prefix cache makes that one token of compute), samples a token nobody reads, and
holds the blocks under a lease, exactly as for a hand-off. Its event carries the lease's
handles; B's work item carries them in ``kv_handles``, and B receives the prefix's blocks
(after those its own cache holds) and computes only the rest
(``workers/serving/handoff_transport.py``: ``expect_peer``).

Nothing new on the wire: the export is a ``prefill`` work item, the handles are KV
hand-off handles, their lease keeps A's blocks in use (never evicted, never written)
until B's notice or expiry. Every failure falls back to recomputing on B, with the
same tokens: A refuses or fails the export, dies, or is too slow (``export_timeout_s``:
B is sent the request without handles, and A's late handles are declined like any
unclaimed ones); a failed or stale transfer on B recomputes the prefix there.

Only for single-rank workers (the KV tiers' rule; the config refuses the rest) that were
introduced to each other (``cluster/bringup.py`` introduces every pair when
``kv_cache.peer_sharing`` is on).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from router.metrics import PEER_EXPORTS
from router.policy import WorkerState, cached_prefix_blocks
from router.workers import WorkerView, abort_on
from workers.protocol.block_hashes import hash_prompt_blocks, salt_root
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.wire import TokenEvent, WorkItem

logger = logging.getLogger(__name__)

# A token sampled by the exporter that never ends the request there (so the blocks are
# held, not freed): nobody reads it.
EXPORT_PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


class ExporterLost(RuntimeError):
    """The exporting worker died (or was replaced) before its handles came."""


@dataclass(frozen=True)
class PeerSource:
    """The worker to pull from, and how many leading prompt blocks it gives."""

    worker: str
    num_blocks: int


def choose_source(
    target: WorkerState,
    workers: Sequence[WorkerState],
    block_hashes: Sequence[int],
    num_prompt_tokens: int,
    block_size: int,
    min_blocks: int,
) -> PeerSource | None:
    """Pure: the healthy worker other than ``target`` (and not draining) that holds the
    longest prefix of the prompt (pool and tiers: ``cached_prefix_blocks``; ties: the least
    loaded), when it holds at least ``min_blocks`` blocks more than ``target``; None
    otherwise. The target computes at least the prompt's last token, so the prefix stops
    one token short."""
    own = cached_prefix_blocks(target, block_hashes)
    usable = (num_prompt_tokens - 1) // block_size
    best: tuple[int, int] | None = None  # (-blocks, load)
    source = None
    for worker in workers:
        if worker.name == target.name or not worker.is_routable:
            continue
        blocks = min(cached_prefix_blocks(worker, block_hashes), usable)
        key = (-blocks, worker.load)
        if best is None or key < best:
            best, source = key, worker
    if source is None or -best[0] - own < max(min_blocks, 1):
        return None
    return PeerSource(source.name, -best[0])


class PeerExports:
    """The router's exports in flight: which worker runs each, and its future handles."""

    def __init__(
        self,
        timeout_s: float,
        decline: Callable[[tuple[bytes, ...]], Awaitable[None]],
        model: str = "",
    ):
        """``decline``: frees handles nobody will read (through any worker, A included);
        ``model``: the served name, for ``baton_router_peer_exports_total``."""
        self.timeout_s = timeout_s
        self._results = {
            result: PEER_EXPORTS.labels("router", model, "router", result)
            for result in ("pulled", "timeout", "refused", "worker_lost", "cancelled")
        }
        self._decline = decline
        self._waiting: dict[str, tuple[str, asyncio.Future]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.num_pulled = 0  # exports whose handles went to the pulling worker
        self.num_fallbacks = 0  # exports that failed: recomputed there instead

    def on_event(self, worker: str, event: TokenEvent) -> bool:
        """An event from ``worker``: True if it was an export's (its end), now consumed."""
        entry = self._waiting.get(event.request_id)
        if entry is None or entry[0] != worker:
            return False
        if not event.finished:
            return True  # an exporter streams nothing before its handles; ignore it
        del self._waiting[event.request_id]
        future = entry[1]
        if not future.done():
            if event.kv_handles:
                future.set_result(event.kv_handles)
            else:
                future.set_exception(RuntimeError(event.error or "ended without handles"))
        return True

    def worker_lost(self, worker: str) -> None:
        for export_id, (name, future) in list(self._waiting.items()):
            if name == worker:
                del self._waiting[export_id]
                if not future.done():
                    future.set_exception(ExporterLost(f"worker {worker} lost"))

    async def export(
        self, source: WorkerView, token_ids: Sequence[int], num_blocks: int, block_size: int
    ) -> tuple[bytes, ...] | None:
        """Ask ``source`` to hold the prompt's first ``num_blocks`` blocks under a lease;
        its handles, or None on any failure (the caller recomputes)."""
        export_id = f"peer-{uuid.uuid4().hex}"
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[export_id] = (source.name, future)
        prompt = tuple(token_ids[: num_blocks * block_size + 1])

        async def run() -> tuple[bytes, ...]:
            await source.client.submit(WorkItem(export_id, prompt, EXPORT_PARAMS, "prefill"))
            return await asyncio.shield(future)

        try:
            # The submit too: a busy exporter must not hold the request up for longer. An
            # export that still runs after this holds its blocks until its unclaimed
            # handles are declined (Router._on_batch), or its lease expires.
            return await asyncio.wait_for(run(), self.timeout_s)
        except asyncio.CancelledError:
            self._results["cancelled"].inc()
            self._give_up(export_id, source, future)
            raise
        except Exception as exc:
            timed_out = isinstance(exc, asyncio.TimeoutError)
            result = "timeout" if timed_out else "refused"
            result = "worker_lost" if isinstance(exc, ExporterLost) else result
            self._results[result].inc()
            why = "timed out" if timed_out else str(exc)
            logger.warning("peer export from %s failed (%s); recomputing", source.name, why)
            self._give_up(export_id, source, future)
            return None

    async def attach(
        self,
        item: WorkItem,
        target: WorkerView,
        workers: Sequence[WorkerView],
        block_size: int,
        min_blocks: int,
    ) -> WorkItem:
        """``item`` (full or prefill, for ``target``) with a peer's handles on its prompt's
        first blocks when another worker holds enough more of it; else ``item`` unchanged."""
        if item.mode == "decode" or item.output_token_ids or item.kv_handles:
            return item
        prompt = item.prompt_token_ids
        source = choose_source(
            target.state(),
            [w.state() for w in workers],
            hash_prompt_blocks(list(prompt), block_size, salt_root(item.params.cache_salt)),
            len(prompt),
            block_size,
            min_blocks,
        )
        if source is None:
            return item
        view = next(w for w in workers if w.name == source.worker)
        handles = await self.export(view, prompt, source.num_blocks, block_size)
        if handles is None:
            self.num_fallbacks += 1
            return item
        self.num_pulled += 1
        self._results["pulled"].inc()
        return replace(item, kv_handles=handles)

    def _give_up(self, export_id: str, source: WorkerView, future: asyncio.Future) -> None:
        """Nobody will read this export: abort it on ``source`` (a held one is left to
        its lease), and decline handles that came already. Handles that come later find
        no export and are declined by the router as unclaimed ones."""
        self._waiting.pop(export_id, None)
        loop = asyncio.get_running_loop()
        if future.done() and not future.cancelled() and future.exception() is None:
            self._spawn(loop, self._decline(future.result()))
        else:
            self._spawn(loop, abort_on(source, export_id))

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro) -> None:
        task = loop.create_task(coro)
        self._tasks.add(task)  # asyncio keeps only weak references
        task.add_done_callback(self._tasks.discard)
