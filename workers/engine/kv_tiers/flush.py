"""The last write-down at a graceful close: what would otherwise die with the process.

Offload happens only when the pool evicts, so at shutdown the disk lacks the blocks still
in the pool (with a large pool, most of the working set) and those the disk writer had not
reached yet. ``KVTierManager.close`` hands both here, most recently used first, and they
are written to the disk tier within a time limit; what does not fit is dropped and
counted. The engine loop has stopped by then, so no block being written is touched: the
pool's committed blocks are immutable and nothing allocates.

Recency on disk: at most the disk's capacity of the most recent blocks are considered
(writing more would evict what this wrote); those the disk holds already are refreshed
first (a held block's ``put`` only refreshes its recency: no data written), so the writes
evict older blocks rather than them. The rest are written most recent first (so the time
limit cuts off the least valuable), which stamps them in reverse; with time left, a last
pass refreshes all of them least recent first, so the next start rebuilds the pool's LRU
order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from workers.engine.kv_tiers.tier import KVTier

logger = logging.getLogger(__name__)

# The default limit. A graceful stop of a worker may take 30 s in all (the cluster's
# ``stop_replicas`` and its own deadline; Helm's grace period is the drain plus 30 s),
# of which the engine loop's stop may take 10: 5 s leaves room for the rest. Measured
# here (DiskTier.put, buffered, no fsync, 2 shared vCPUs): 1.0 GB/s of 2 MiB blocks, 0.09
# GB/s of 64 KiB ones (a file each), so ~5 GB or ~450 MiB; of a larger pool the most
# recent part goes down (docs/kv-tiers.md).
FLUSH_S = 5.0

# Reads one block into a tensor of ``block_bytes`` (or returns a view of it); None when
# the block is gone (a pending block the host tier evicted).
Reader = Callable[[], torch.Tensor | None]


@dataclass(frozen=True)
class FlushStats:
    """The write-down at close (blocks)."""

    written: int = 0
    dropped: int = 0  # not written: time or the disk's capacity ran out, or gone from G2
    failed: int = 0  # the disk's put refused it or raised
    seconds: float = 0.0


def flush(disk: KVTier, blocks: Iterable[tuple[int, Reader]], deadline: float) -> FlushStats:
    """Write ``blocks`` (hash, reader), most recent first, into ``disk`` until
    ``time.monotonic()`` reaches ``deadline``. Only the most recent ``capacity`` of them
    count (more would evict what this wrote); of those, the ones the disk holds are
    refreshed first (so the writes evict older blocks, not them), then the others are
    written. A put in progress at the deadline is finished: the limit is overrun by one
    block's write."""
    start = time.monotonic()
    readers: dict[int, Reader] = {}
    for block_hash, reader in blocks:
        readers.setdefault(block_hash, reader)
    keep = list(readers)[: disk.stats().capacity_blocks]
    lacking = [h for h in readers if not disk.contains(h)]
    lacking_set = set(lacking)
    held = [h for h in keep if h not in lacking_set]
    for block_hash in held:
        if time.monotonic() >= deadline:
            break
        _put(disk, block_hash, readers[block_hash])
    to_write = [h for h in keep if h in lacking_set]
    written: list[int] = []
    failed = 0
    for block_hash in to_write:
        if time.monotonic() >= deadline:
            break
        ok = _put(disk, block_hash, readers[block_hash], log=failed == 0)
        if ok:
            written.append(block_hash)
        elif ok is not None:
            failed += 1
    # Least recent first, so the file stamps order them as the pool did (cheap: a put of
    # a held block is a recency refresh; skipped when time is up).
    stored = set(written).union(held)
    for block_hash in reversed(keep):
        if time.monotonic() >= deadline:
            break
        if block_hash in stored:
            _put(disk, block_hash, readers[block_hash])
    dropped = len(lacking) - len(written) - failed
    return FlushStats(len(written), dropped, failed, time.monotonic() - start)


def _put(disk: KVTier, block_hash: int, reader: Reader, log: bool = False) -> bool | None:
    """Whether ``disk`` stored the block; None when the reader has it no more."""
    data = reader()
    if data is None:
        return None
    try:
        return bool(disk.put(block_hash, data))
    except Exception:
        if log:  # once per flush: a broken disk fails every block
            logger.exception("KV tier %s: writing a block at close failed", disk.name)
        return False
