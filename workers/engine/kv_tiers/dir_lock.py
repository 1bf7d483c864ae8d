"""One process per disk tier directory: an exclusive lock (``filelock``) on a file in it.

Two processes on one directory (two clusters on one machine with the same
``kv_cache.disk_tier_path`` both have a ``decode-0``) would corrupt each other's cache: one
evicts (unlinks) files the other indexed, and a starting tier's scan removes the other's
in-flight temporary files. So the disk tier's root is locked for the tier's lifetime
(taken before the tier scans it, released by ``KVTierManager.close``) and a second
process is refused with the directory and the holder's pid.

``filelock``'s native lock is ``flock`` on Unix: the kernel releases it when the process
dies (SIGKILL included: a restarted worker takes the directory over at once), and a second
open of the file in the *same* process conflicts too (two engines in one process are two
tiers). Its soft fallback (a marker file, for file systems without ``flock``) is refused
here: a marker outlives a killed holder and would lock the directory for good; such a
file system serves unlocked, with a warning. The holder writes its pid into the lock file
for the refusal's message; the file is left behind at release (removing it would race
with a process that opened it meanwhile).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"  # in the tier's root; the disk tier's blocks live a level below
POLL_S = 0.1


class DirectoryInUse(RuntimeError):
    """Another process (or another tier in this one) holds the directory."""


class DirLock:
    """An exclusive lock on ``directory`` held until :meth:`release` or the process ends."""

    def __init__(self, directory: Path, lock: FileLock | None) -> None:
        self.directory = directory
        self._lock = lock  # None: the file system does not lock (warned), nothing held

    @classmethod
    def acquire(cls, directory: Path, wait_s: float = 0.0) -> DirLock:
        """Lock ``directory`` (made if missing), trying for up to ``wait_s`` seconds (a
        predecessor killed a moment ago may still be exiting), else raise
        :class:`DirectoryInUse`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        lock = FileLock(
            path,
            mode=0o600,
            # The tier is closed by whichever thread shuts the engine down, not
            # necessarily the one that built it.
            thread_local=False,
            fallback_to_soft=False,
            preserve_lock_file=True,
            on_acquired=_write_pid,
        )
        try:
            lock.acquire(timeout=wait_s, poll_interval=POLL_S)
        except Timeout:
            holder = _read_pid(path)
            who = f"pid {holder}" if holder else "a process whose pid is unknown"
            raise DirectoryInUse(
                f"KV disk tier directory {directory} is in use by {who} (lock "
                f"{path}): each worker needs a directory of its own; give this "
                "cluster another kv_cache.disk_tier_path"
            ) from None
        except (NotImplementedError, OSError) as exc:
            # ENOLCK, EOPNOTSUPP, ...: a file system without locks. Serving beats
            # refusing here; the one-directory-per-process rule is then the user's.
            logger.warning(
                "KV disk tier %s: cannot lock %s (%s); another process using the "
                "same directory would corrupt the cache",
                directory,
                path,
                getattr(exc, "strerror", None) or exc,
            )
            return cls(directory, None)
        return cls(directory, lock)

    @property
    def held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        """Give the directory up (idempotent)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(force=True)


def _write_pid(fd: int) -> None:
    # The descriptor is filelock's (borrowed): write through it, never close it.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_bytes()[:32].decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
