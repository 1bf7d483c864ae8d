"""One process per disk tier directory: an exclusive ``flock`` on a lock file in it.

Two processes on one directory (two clusters on one machine with the same
``kv_cache.disk_tier_path`` both have a ``decode-0``) would corrupt each other's cache: one
evicts (unlinks) files the other indexed, and a starting tier's scan removes the other's
in-flight temporary files. So the disk tier's root is locked for the tier's lifetime
(taken before the tier scans it, released by ``KVTierManager.close``) and a second
process is refused with the directory and the holder's pid.

``flock``, not ``fcntl`` record locks: the kernel releases it when the process dies
(SIGKILL included: a restarted worker takes the directory over at once), and a second
open of the file in the *same* process conflicts too (two engines in one process are two
tiers). The holder writes its pid into the file for the refusal's message; the file is
left behind at release (removing it would race with a process that opened it meanwhile).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"  # in the tier's root; the disk tier's blocks live a level below


class DirectoryInUse(RuntimeError):
    """Another process (or another tier in this one) holds the directory."""


class DirLock:
    """An exclusive lock on ``directory`` held until :meth:`release` or the process ends."""

    def __init__(self, directory: Path, fd: int | None) -> None:
        self.directory = directory
        self._fd = fd  # None: the file system does not lock (warned), nothing held

    @classmethod
    def acquire(cls, directory: Path, wait_s: float = 0.0) -> DirLock:
        """Lock ``directory`` (made if missing), trying for up to ``wait_s`` seconds (a
        predecessor killed a moment ago may still be exiting), else raise
        :class:`DirectoryInUse`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_pid(fd)
                    os.close(fd)
                    who = f"pid {holder}" if holder else "a process whose pid is unknown"
                    raise DirectoryInUse(
                        f"KV disk tier directory {directory} is in use by {who} (lock "
                        f"{path}): each worker needs a directory of its own; give this "
                        "cluster another kv_cache.disk_tier_path"
                    ) from None
                time.sleep(0.1)
            except OSError as exc:
                # ENOLCK, EOPNOTSUPP, ...: a file system without locks. Serving beats
                # refusing here; the one-directory-per-process rule is then the user's.
                os.close(fd)
                logger.warning(
                    "KV disk tier %s: cannot lock %s (%s); another process using the "
                    "same directory would corrupt the cache",
                    directory,
                    path,
                    exc.strerror or exc,
                )
                return cls(directory, None)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(directory, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the directory up (idempotent). Closing the file drops the ``flock``."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
