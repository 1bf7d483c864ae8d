"""Keep glibc from returning big tensor buffers to the OS between steps (CPU engines).

By default glibc serves every allocation above a threshold (dynamic, at most 32 MiB on
64-bit) with a fresh ``mmap`` and unmaps it on free, so each large per-step tensor (the
gathered KV context, prefill activations) page-faults its whole size again on every step.
Measured on our 2-core machines: gathering 50 MB of KV context took 78 ms with fresh pages
and 3.9 ms into reused ones, a 64 MiB memcpy-bound op. Turning off mmap for malloc and
never trimming the heap keeps freed buffers mapped and reused — what CPU serving stacks get
by preloading jemalloc or tcmalloc, without the preload. The cost: the process keeps its
peak heap size mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_MAX_INT = 2**31 - 1


def keep_freed_memory_mapped() -> bool:
    """Apply the setting process-wide; returns False where the C library has no ``mallopt``."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _MAX_INT))
    if not ok:
        logger.warning("mallopt refused the CPU memory settings; large steps may page-fault")
    return ok
