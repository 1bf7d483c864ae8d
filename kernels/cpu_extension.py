"""The CPU kernels' C++ module (``kernels/csrc``): decode attention over the paged KV cache
(``cpu_paged_decode.py``), RMSNorm, and the fused decoder-layer stack
(``workers/models/fused_decode.py``).

Built on first use with torch's C++ extension loader (gcc, ``-O3 -march=native``, OpenMP:
the threads are torch's own intra-op threads) into torch's extension cache, under a name
that hashes the sources, this CPU's model and flags, and torch's version, so a cache shared
by unlike machines never loads code built for another instruction set, and an edited
source is rebuilt. A second process finds it built (about 40 s the first time on the
2-core VM, well under a second after).

``load()`` returns the module, or None where it cannot be built (no compiler, no
``ninja``, a build error, another process's build still holding the lock after
``BUILD_WAIT_S``: logged once with the reason); callers then keep the PyTorch paths.
``BATON_CPU_KERNELS=0`` turns it off.

Concurrent starts (the workers of a node) build once: the build runs under an OS file lock
(``filelock``) that the kernel releases when its holder dies. torch's own guard is a
``lock`` file that a build killed midway leaves behind, after which every later process
waited on it forever (seen in this project's tests); under our lock such a file can only
be stale, so it is removed (and logged) before torch looks.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
_MAIN = "cpu_kernels.cpp"  # the one translation unit; it includes the headers
BUILD_WAIT_S = 600.0  # how long a process waits for another's build before giving up


def _cpu_fingerprint() -> str:
    """The CPU's model name and feature flags (Linux), else what ``platform`` knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _sources(csrc: Path) -> list[Path]:
    return sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))


def extension_name(csrc: Path | None = None) -> str:
    """The built module's name: the sources, this CPU and torch's version, hashed."""
    digest = hashlib.sha256()
    for path in _sources(csrc or CSRC):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(_cpu_fingerprint().encode() + torch.__version__.encode())
    return f"baton_cpu_kernels_{digest.hexdigest()[:12]}"


@functools.cache
def load(csrc: Path | None = None) -> ModuleType | None:
    """The built module, or None (reason logged once) where it is unavailable."""
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return None
    csrc = csrc or CSRC
    name = extension_name(csrc)
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        build_dir = Path(_get_build_directory(name, False))
        with FileLock(str(build_dir) + ".flock", timeout=BUILD_WAIT_S):
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that was killed midway", stale)
                stale.unlink(missing_ok=True)
            return load_extension(
                name=name,
                sources=[str(csrc / _MAIN)],
                extra_include_paths=[str(csrc)],
                # No contraction of a product and a sum into one FMA: the eager ops round
                # both (rotary), and the two paths must agree to the bit.
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Timeout:
        reason = f"another process held the build lock for over {BUILD_WAIT_S:.0f} s"
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    logger.warning(
        "the C++ CPU kernels could not be built (%s); decode attention and the decoder "
        "layers run on the PyTorch paths", reason,
    )  # fmt: skip
    return None
