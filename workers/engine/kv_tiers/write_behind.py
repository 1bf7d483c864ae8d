"""The disk writer: copies blocks from a host-memory tier down to a slower one, on its own
thread, so that no engine step ever waits for a disk.

The engine thread only ``submit``s a hash (the block was just stored in the host-memory
tier ``source``); the thread copies it out of ``source`` (``HostTier.peek``: a memcpy under
the tier's lock) into its own buffer and ``put``s it into ``dest``. The queue is bounded:
when the writer falls behind, the oldest pending hash is dropped (counted), and a hash whose
block ``source`` evicted before the writer got to it is dropped too. A slow or full disk
therefore costs offloads, never steps. ``dest.put`` returning False or raising counts as a
failure; the writer goes on with the next block.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import torch

from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.tier import KVTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteBehindStats:
    submitted: int = 0
    written: int = 0  # dest.put returned True
    dropped: int = 0  # queue full, or gone from the source before it was copied
    failed: int = 0  # dest.put returned False or raised


class WriteBehind:
    def __init__(
        self, source: HostTier, dest: KVTier, max_pending: int, inline: bool = False
    ) -> None:
        """``inline``: no thread; ``submit`` writes the block before it returns (the
        property tests' schedules must not depend on a thread's timing)."""
        self.source = source
        self.dest = dest
        self.max_pending = max(1, max_pending)
        self._buf = torch.empty(source.block_bytes, dtype=torch.uint8)
        self._queue: deque[int] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._submitted = self._written = self._dropped = self._failed = 0
        self._logged_failure = False
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
            self._thread.start()

    def submit(self, block_hash: int) -> None:
        """Queue a block ``source`` holds for ``dest`` (engine thread; never blocks on I/O)."""
        if self._thread is None:
            with self._cond:
                self._submitted += 1
            self._write(block_hash)
            return
        with self._cond:
            if self._closed:
                return
            self._submitted += 1
            if len(self._queue) >= self.max_pending:
                self._queue.popleft()  # the oldest: the likeliest to have left the source
                self._dropped += 1
            self._queue.append(block_hash)
            self._cond.notify()

    def wait_idle(self) -> None:
        """Block until every submitted block is written or dropped (tests, benchmarks)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (not self._queue and not self._busy))

    def stats(self) -> WriteBehindStats:
        with self._cond:
            return WriteBehindStats(self._submitted, self._written, self._dropped, self._failed)

    def close(self) -> list[int]:
        """Stop after the block in hand; returns the pending hashes, oldest first, which
        were neither written nor counted (the manager writes them down at close, or
        drops and counts them)."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        return pending

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._queue))
                if self._closed:
                    return
                block_hash = self._queue.popleft()
                self._busy = True
            self._write(block_hash)

    def _write(self, block_hash: int) -> None:
        written = failed = False
        if self.source.peek(block_hash, self._buf):
            try:
                written = bool(self.dest.put(block_hash, self._buf))
                failed = not written
            except Exception:
                failed = True
                if not self._logged_failure:  # once: a broken disk fails every block
                    logger.exception("KV tier %s: offload failed", self.dest.name)
                    self._logged_failure = True
        with self._cond:
            self._busy = False
            self._written += written
            self._failed += failed
            self._dropped += not (written or failed)
            self._cond.notify_all()
