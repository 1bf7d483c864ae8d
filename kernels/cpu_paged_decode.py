"""Decode attention over the paged KV cache in C++ on CPU, reading each K/V row once.

The kernel is ``kernels/csrc/paged_decode.cpp`` (layouts and the reason there), built on
first use with torch's C++ extension loader (gcc, ``-O3 -march=native``, OpenMP: the
threads are torch's own intra-op threads) into torch's extension cache, under a name that
includes this CPU's model and flags, so a cache shared by unlike machines never loads code
built for another instruction set. A second process finds it built (about 20 s the first
time on the 2-core VM, well under a second after).

``load()`` returns the kernel, or None where it cannot be built (no compiler, no
``ninja``, a build error: logged once with the reason); callers then keep the PyTorch
reference (``kernels/paged_attention.py``). ``BATON_CPU_KERNELS=0`` turns it off.

Numerics: float32 scores and sums, like the reference, but in another order (one pass
over positions instead of ``bmm`` tiles), so results agree to float rounding, not bits.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from typing import Protocol

import torch

from kernels.timing import fastest

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"


class PagedDecode(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...


def _cpu_fingerprint() -> str:
    """The CPU's model name and feature flags (Linux), else what ``platform`` knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def extension_name() -> str:
    """The built module's name: the source, this CPU and torch's version, hashed."""
    digest = hashlib.sha256(
        _SOURCE.read_bytes() + _cpu_fingerprint().encode() + torch.__version__.encode()
    ).hexdigest()[:12]
    return f"baton_paged_decode_{digest}"


@functools.cache
def load() -> PagedDecode | None:
    """The built kernel's ``paged_decode``, or None (reason logged) where it is unavailable."""
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        module = load_extension(
            name=extension_name(),
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:
        logger.warning(
            "the C++ paged decode kernel could not be built (%s: %s); decode attention "
            "runs on the PyTorch reference", type(exc).__name__, str(exc).splitlines()[0][:200],
        )  # fmt: skip
        return None
    return module.paged_decode


def measure(decode: PagedDecode, repeats: int = 5) -> tuple[float, float]:
    """(kernel, reference) seconds for one layer's decode attention of 8 decodes of 300
    tokens (4 query heads per KV head, 2 KV heads, head_dim 64, blocks of 16), the
    minimum of ``repeats`` alternating rounds: a few milliseconds at start-up."""
    from kernels.attention_metadata import build_attention_metadata
    from kernels.paged_attention import _decode_attention

    gen = torch.Generator().manual_seed(0)
    num_seqs, seq_len, block_size = 8, 300, 16
    blocks = -(-seq_len // block_size)
    cache = torch.randn(num_seqs * blocks, 2, 2, block_size, 64, generator=gen)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    query = torch.randn(num_seqs, 8, 64, generator=gen)
    metadata = build_attention_metadata(
        [1] * num_seqs, [seq_len] * num_seqs, tables.numpy(), list(range(num_seqs)), num_seqs
    )
    with torch.inference_mode():
        kernel_s, reference_s = fastest(
            [
                lambda: decode(query, cache, metadata.block_tables, metadata.seq_lens, 0.125),
                lambda: _decode_attention(query, cache, metadata, 0.125),
            ],
            repeats,
        )
    return kernel_s, reference_s
