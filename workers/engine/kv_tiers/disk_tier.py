"""G3: KV blocks in files on a local disk, kept across restarts of the worker.

Layout: ``<root>/<fingerprint.digest>/<block hash as 16 hex>.kvb``, one file per block
(format and atomic writes: ``block_file.py``). ``root`` belongs to one worker process; a
cache written under another fingerprint lives in another directory and is never read
(each file's header carries the digest too, checked on every read).

Recency is the file's mtime, stamped explicitly from a strictly increasing clock on every
store and hit, so a new ``DiskTier`` on the same root rebuilds the LRU order from one
``scandir`` + ``stat`` per file (no header is read at start; checksums are verified on
read). Files whose size cannot be a block, and temporary files of an interrupted write,
are removed at start; the tier is then trimmed to ``capacity_bytes``, least recent first.

Failures: a get of a corrupt, truncated, foreign, vanished or unreadable file is a miss
(``errors`` and ``misses`` count it, each kind is logged once, the file is removed), never
wrong bytes and never an exception. A write that fails (a full disk: ENOSPC; EIO, ...) is a
rejected put; writes then pause for ``write_backoff_s`` (doubling up to ten times that while
they keep failing) and reads go on: a full disk stops offload, not serving.

Threads: one lock guards the index, counters and events; file I/O runs outside it, so the
engine's get does not wait for an offload thread's write (puts run one at a time under a
second lock). A file evicted while a get has it open is still read whole (POSIX unlink
semantics); one evicted before the open is a plain miss, not an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from workers.engine.kv_tiers import block_file
from workers.engine.kv_tiers.block_file import HEADER_LEN
from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.tier import TierEvents, TierStats

logger = logging.getLogger(__name__)

# How far ahead of the gets ``prefetch`` keeps the disk reading (measured: 16 blocks of
# 2 MiB ahead read 0.87 GB/s cold against 0.71 plain; all 256 at once 0.74).
PREFETCH_BYTES = 32 << 20


class DiskTier:
    """The disk tier (G3); implements :class:`~workers.engine.kv_tiers.tier.KVTier`."""

    name = "disk"

    def __init__(
        self,
        root: Path,
        fingerprint: CacheFingerprint,
        block_bytes: int,
        capacity_bytes: int,
        *,
        write_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        key: bytes | None = None,
    ) -> None:
        """``key``: the deployment's secret; blocks are MAC'd with it and only blocks whose
        MAC verifies are read (block_file.py). None: checksums only."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.directory = Path(root) / fingerprint.digest
        self._key = key
        _private_dir(self.directory)
        self._dir_prefix = f"{self.directory}{os.sep}"  # str paths: pathlib costs µs per get
        self._digest = block_file.digest_bytes(fingerprint.digest)
        self._file_bytes = HEADER_LEN + block_bytes
        self._capacity_blocks = max(0, capacity_bytes) // self._file_bytes
        self._backoff_s = write_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._index: OrderedDict[int, None] = OrderedDict()  # least recent first
        self._last_stamp_ns = 0
        # Hash -> whether it was held at the last drain_events (first change only).
        self._changed: dict[int, bool] = {}
        self._logged: set[str] = set()
        self._writes_paused_until = 0.0
        self._failed_writes_in_row = 0
        self._closed = False
        self._read_ahead: deque[int] = deque()  # prefetch's rest
        self._counts = dict.fromkeys(
            ("hits", "misses", "errors", "onboard_bytes", "offload_bytes", "evictions"), 0
        )
        self._counts["rejected"] = 0
        self._onboard_seconds = 0.0
        self._offload_seconds = 0.0
        self._scan()

    # -- KVTier ------------------------------------------------------------------------

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def get(self, block_hash: int, out: torch.Tensor) -> bool:
        self._check_args(block_hash, out, "out")
        with self._lock:
            if self._closed or block_hash not in self._index:
                self._counts["misses"] += 1
                return False
            touch_ns = self._next_stamp_ns()
            ahead = self._read_ahead.popleft() if self._read_ahead else None
        if ahead is not None:
            self._advise((ahead,))
        start = time.perf_counter()
        host = out if out.is_cpu else torch.empty_like(out, device="cpu")
        bad = block_file.read_block(
            self._path(block_hash), self._digest, block_hash, _bytes_view(host), touch_ns, self._key
        )
        if bad is None and host is not out:
            out.copy_(host)
        elapsed = time.perf_counter() - start
        if bad is not None:
            self._ranges_failed(block_hash, bad)
            return False
        self._hit(block_hash, elapsed)
        return True

    def put(self, block_hash: int, data: torch.Tensor) -> bool:
        self._check_args(block_hash, data, "data")
        # Puts run one at a time (there is one offload thread anyway), so a block's file
        # is never unlinked as a victim by one put while another writes it anew.
        with self._put_lock:
            with self._lock:
                if self._closed:
                    self._counts["rejected"] += 1
                    return False
                stamp_ns = self._next_stamp_ns()
                if block_hash in self._index:  # blocks are immutable: only refresh recency
                    self._index.move_to_end(block_hash)
                    self._touch(block_hash, stamp_ns)
                    return True
                if self._capacity_blocks == 0 or self._clock() < self._writes_paused_until:
                    self._counts["rejected"] += 1
                    return False
                victims = self._make_room(1)
            for victim in victims:
                self._unlink(self._path(victim))
            start = time.perf_counter()
            payload = _bytes_view(data if data.is_cpu else data.cpu())
            header = block_file.make_header(self._digest, block_hash, payload, self._key)
            try:
                block_file.write_block(self._path(block_hash), header, payload, stamp_ns)
            except OSError as exc:
                self._write_failed(exc)
                return False
            elapsed = time.perf_counter() - start
            with self._lock:
                self._failed_writes_in_row = 0
                self._counts["offload_bytes"] += self.block_bytes
                self._offload_seconds += elapsed
                self._index[block_hash] = None
                self._note_change(block_hash, held_before=False)
            return True

    def open_ranges(self, block_hash: int) -> block_file.RangeReader | None:
        """The block's file, to be read in ranges of its payload (the layer-wise
        onboarding); None on a miss (counted, a bad file removed, as ``get``). The caller
        reports the outcome with ``ranges_done``. Not part of :class:`KVTier`."""
        with self._lock:
            if self._closed or block_hash not in self._index:
                self._counts["misses"] += 1
                return None
        opened = block_file.RangeReader.open(
            self._path(block_hash), self._digest, block_hash, self.block_bytes, self._key
        )
        if isinstance(opened, block_file.BadBlock):
            self._ranges_failed(block_hash, opened)
            return None
        return opened

    def ranges_done(
        self, block_hash: int, reader: block_file.RangeReader, bad: block_file.BadBlock | None,
        seconds: float,
    ) -> bool:  # fmt: skip
        """``reader`` read every range (``bad`` None) or failed: verify, count, close."""
        with self._lock:
            touch_ns = self._next_stamp_ns()
        if bad is None:
            bad = reader.finish(touch_ns)
        reader.close()
        if bad is not None:
            self._ranges_failed(block_hash, bad)
            return False
        self._hit(block_hash, seconds)
        return True

    def _hit(self, block_hash: int, seconds: float) -> None:
        with self._lock:
            self._counts["hits"] += 1
            self._counts["onboard_bytes"] += self.block_bytes
            self._onboard_seconds += seconds
            if block_hash in self._index:
                self._index.move_to_end(block_hash)

    def _ranges_failed(self, block_hash: int, bad: block_file.BadBlock) -> None:
        with self._lock:
            self._counts["misses"] += 1
            if block_hash in self._index:  # else: evicted while we read, a plain miss
                self._counts["errors"] += 1
                self._drop(block_hash)
                self._unlink(self._path(block_hash))
                self._log_once(bad.value, f"a {bad.value} block file is a miss (removed)")

    def prefetch(self, block_hashes: Iterable[int]) -> int:
        """Read these blocks ahead of the gets that will follow, in this order: the kernel
        starts reading the first ``PREFETCH_BYTES`` of them into the page cache at once
        (``posix_fadvise(WILLNEED)``, no waiting), and each later ``get`` starts the next
        one, so the disk works on a window of blocks instead of one per get. A window, not
        all of them: tens of MiB keep the disk busy, hundreds flood its queue and the page
        cache for nothing (docs/kv-tiers.md). Replaces the previous call's remaining blocks.
        Not part of :class:`KVTier`. Returns how many of the blocks are held."""
        window = max(1, PREFETCH_BYTES // self._file_bytes)
        with self._lock:
            held = [h for h in block_hashes if h in self._index]
            self._read_ahead = deque(held[window:])
        self._advise(held[:window])
        return len(held)

    def _advise(self, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            with contextlib.suppress(OSError):  # a hint: get reports what is wrong
                fd = os.open(self._path(block_hash), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def hashes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._index)

    def drain_events(self) -> TierEvents:
        with self._lock:
            stored = tuple(h for h, was in self._changed.items() if not was and h in self._index)
            removed = tuple(h for h, was in self._changed.items() if was and h not in self._index)
            self._changed.clear()
        return TierEvents(stored=stored, removed=removed)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self.name,
                blocks=len(self._index),
                bytes=len(self._index) * self._file_bytes,
                capacity_blocks=self._capacity_blocks,
                onboard_seconds=self._onboard_seconds,
                offload_seconds=self._offload_seconds,
                **self._counts,
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True

    # -- beyond the protocol ------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if the index and the directory disagree (tests): every
        held block has its file, every block file is held, and the tier fits."""
        with self._put_lock, self._lock:
            names = {
                e.name
                for e in os.scandir(self.directory)
                if block_file.parse_file_name(e.name) is not None
            }
            held = {block_file.file_name(h) for h in self._index}
            assert names == held, f"files {sorted(names ^ held)} disagree with the index"
            assert len(self._index) <= self._capacity_blocks

    # -- internals ---------------------------------------------------------------------

    def _scan(self) -> None:
        """Find the blocks a previous run left (size check only), oldest first."""
        found: list[tuple[int, int]] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(block_file.TEMP_SUFFIX) and entry.name.startswith("."):
                self._unlink(entry.path)  # an interrupted write of a previous run
                continue
            block_hash = block_file.parse_file_name(entry.name)
            if block_hash is None:
                self._log_once("foreign_name", f"ignoring {entry.path}: not a block file")
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not entry.is_file(follow_symlinks=False) or st.st_size != self._file_bytes:
                self._counts["errors"] += 1
                self._log_once("bad_size", f"{entry.path} cannot be a block file (removed)")
                self._unlink(entry.path)
                continue
            found.append((st.st_mtime_ns, block_hash))
        found.sort()
        for mtime_ns, block_hash in found:
            self._index[block_hash] = None
            self._note_change(block_hash, held_before=False)
            self._last_stamp_ns = max(self._last_stamp_ns, mtime_ns)
        for victim in self._make_room(0):
            self._unlink(self._path(victim))
        if found:
            logger.info(
                "disk tier %s: found %d blocks, kept %d",
                self.directory,
                len(found),
                len(self._index),
            )

    def _make_room(self, num_new: int) -> list[int]:
        """Drop least recent blocks from the index until ``num_new`` more fit (lock held).
        The caller unlinks the returned blocks' files after releasing the lock."""
        victims: list[int] = []
        while self._index and len(self._index) + num_new > self._capacity_blocks:
            victim, _ = self._index.popitem(last=False)
            self._note_change(victim, held_before=True)
            self._counts["evictions"] += 1
            victims.append(victim)
        return victims

    def _touch(self, block_hash: int, stamp_ns: int) -> None:
        # The recency on disk is only a hint for the next start.
        with contextlib.suppress(OSError):
            os.utime(self._path(block_hash), ns=(stamp_ns, stamp_ns))

    def _drop(self, block_hash: int) -> None:
        del self._index[block_hash]
        self._note_change(block_hash, held_before=True)

    def _note_change(self, block_hash: int, *, held_before: bool) -> None:
        self._changed.setdefault(block_hash, held_before)

    def _write_failed(self, exc: OSError) -> None:
        if isinstance(exc, FileNotFoundError):
            # The directory was removed behind the tier's back: make it again for the
            # next try (the blocks it held are gone; their gets will be counted misses).
            with contextlib.suppress(OSError):
                _private_dir(self.directory)
        with self._lock:
            self._counts["rejected"] += 1
            self._failed_writes_in_row += 1
            # 1x, 2x, 4x, 8x, then 10x the back-off while the disk stays full.
            pause = self._backoff_s * min(10, 2 ** (self._failed_writes_in_row - 1))
            self._writes_paused_until = self._clock() + pause
            self._log_once(
                f"write_{exc.errno}",
                f"writing a block failed ({exc.strerror or exc}); "
                f"offload to disk paused for {pause:g}s (reads go on)",
            )

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("disk tier %s: %s", self.directory, message)

    def _next_stamp_ns(self) -> int:
        # Strictly increasing even when the wall clock is coarse or steps back, so the
        # mtimes read at the next start give the exact recency order (lock held).
        self._last_stamp_ns = max(self._last_stamp_ns + 1, time.time_ns())
        return self._last_stamp_ns

    def _path(self, block_hash: int) -> str:
        return self._dir_prefix + block_file.file_name(block_hash)

    def _check_args(self, block_hash: int, tensor: torch.Tensor, what: str) -> None:
        if not 0 <= block_hash < 2**64:
            raise ValueError(f"a block hash is an unsigned 64-bit integer, got {block_hash}")
        if (
            tensor.dtype != torch.uint8
            or not tensor.is_contiguous()
            or tensor.numel() != self.block_bytes
        ):
            raise ValueError(
                f"{what} must be a contiguous uint8 tensor of {self.block_bytes} bytes, "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )

    @staticmethod
    def _unlink(path: str) -> None:
        # Already gone, or the disk is failing: either way the index no longer has it.
        with contextlib.suppress(OSError):
            os.unlink(path)


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a CPU tensor's memory (no copy)."""
    return memoryview(tensor.numpy()).cast("B")


def _private_dir(directory: Path) -> None:
    """Make ``directory`` (and missing parents) readable by this user only, and narrow it
    if an older run left it wider: the blocks are other requests' KV."""
    directory.mkdir(mode=block_file.DIR_MODE, parents=True, exist_ok=True)
    for path in (directory, directory.parent):  # the worker's root and its fingerprint's
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(block_file.DIR_MODE)
