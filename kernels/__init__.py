"""Model-side compute ops, chosen once per device and passed to the model.

``get_kernel_ops(device)`` returns a ``KernelOps``; the model holds it and calls through it,
so dispatch happens at start-up, never per call: CUDA devices get the Triton kernels
(``kernels/triton_*.py``), CPUs the plain-PyTorch references with RMSNorm and decode attention
from the C++ module of ``kernels/cpu_extension.py`` (where it builds and measures faster),
other devices the references, against which the Triton and C++ kernels are tested. Triton
is imported only when a Triton op set is asked for, so CPU-only installs need no Triton.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from kernels import batch_invariant, cpu_extension, cpu_paged_decode
from kernels.activation import silu_and_mul
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_store import store_kv
from kernels.mla_attention import mla_decode_attention
from kernels.moe import fused_moe
from kernels.paged_attention import paged_attention
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelOps:
    """The op set a model runs with; see each op's module for layouts.

    Mutation contract, shared by both op sets:
    - ``apply_rotary`` returns the rotated ``(q, k)`` and *may* rotate its inputs in place
      (the Triton op does; the reference returns new tensors): callers use the returned pair
      and never read the inputs again.
    - ``store_kv`` mutates only the cache; ``paged_attention``, ``rms_norm``,
      ``fused_add_rms_norm`` and ``silu_and_mul`` return new tensors and mutate nothing.
    """

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    apply_rotary: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor],
    ]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    paged_attention: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
    # Mixture-of-Experts layers (kernels/moe.py has the layouts); one op for every set until a
    # set brings its own (the Triton fused kernel on CUDA).
    fused_moe: Callable[..., torch.Tensor] = fused_moe
    # Multi-head latent attention's decodes on the latent cache (kernels/mla_attention.py;
    # the Triton set's: kernels/triton_mla_decode.py).
    mla_decode_attention: Callable[..., torch.Tensor] = mla_decode_attention
    # Its prefill chunks on the latent rows, absorbed (kernels/triton_mla_prefill.py); None:
    # the layer expands each chunk in PyTorch (workers/models/mla.py), the cheaper form on
    # CPU for long chunks and the arithmetic transformers does.
    mla_prefill_attention: Callable[..., torch.Tensor] | None = None
    is_triton: bool = False  # the Triton set (CUDA, or its interpreter in tests)
    # The C++ CPU set (kernels/csrc): its norms, SiLU and decode attention are the ones the
    # C++ layer stack (workers/models/fused_decode.py) computes with, so the two agree bitwise.
    is_cpu_kernels: bool = False
    # Every op gives a row bits that depend on that row alone (kernels/batch_invariant.py):
    # attention per query token; the model's linears pad a lone row (model.deterministic).
    is_batch_invariant: bool = False


REFERENCE_OPS = KernelOps(
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    silu_and_mul=silu_and_mul,
    store_kv=store_kv,
    paged_attention=paged_attention,
)


def triton_kernel_ops() -> KernelOps:
    """The Triton op set (imports Triton; raises ImportError naming the fix when it is missing).

    Runs compiled on CUDA tensors, or in Triton's interpreter on CPU tensors when
    ``TRITON_INTERPRET=1`` was set before Triton was first imported (tests).
    """
    try:
        from kernels import (
            triton_activation,
            triton_attention,
            triton_kv_store,
            triton_mla_decode,
            triton_mla_prefill,
            triton_moe,
            triton_rms_norm,
            triton_rotary,
        )
    except ImportError as exc:
        raise ImportError(
            f"the Triton kernels need the `triton` package ({exc}); install it with "
            "`pip install triton` (CUDA builds of torch on Linux ship it)"
        ) from exc
    return KernelOps(
        rms_norm=triton_rms_norm.rms_norm,
        fused_add_rms_norm=triton_rms_norm.fused_add_rms_norm,
        apply_rotary=triton_rotary.apply_rotary,
        silu_and_mul=triton_activation.silu_and_mul,
        store_kv=triton_kv_store.store_kv,
        paged_attention=triton_attention.paged_attention,
        fused_moe=triton_moe.fused_moe,
        mla_decode_attention=triton_mla_decode.mla_decode_attention,
        mla_prefill_attention=triton_mla_prefill.mla_prefill_attention,
        is_triton=True,
    )


@functools.cache
def cpu_kernel_ops() -> KernelOps:
    """The CPU op set: the references, with RMSNorm, SiLU-and-multiply and decode
    attention from the C++ module (``kernels/cpu_extension.py``) where it builds and a timing of both here finds
    its decode attention faster (logged once per process); otherwise exactly
    ``REFERENCE_OPS``."""
    module = cpu_extension.load()
    decode = cpu_paged_decode.load()
    if module is None or decode is None:
        return REFERENCE_OPS
    cpp_s, reference_s = cpu_paged_decode.measure(decode)
    logger.info(
        "decode attention: C++ kernel %.0f us, PyTorch reference %.0f us (8 decodes of "
        "300 tokens, one layer): %s", cpp_s * 1e6, reference_s * 1e6,
        "C++ kept" if cpp_s < reference_s else "reference kept",
    )  # fmt: skip
    if cpp_s >= reference_s:
        return REFERENCE_OPS
    return _cpp_ops(module, partial(paged_attention, decode_fn=decode))


def _cpp_ops(module, attention: Callable) -> KernelOps:
    """The references with the C++ module's norms and SiLU and ``attention``."""
    return replace(
        REFERENCE_OPS,
        rms_norm=module.rms_norm,
        fused_add_rms_norm=module.fused_add_rms_norm,
        silu_and_mul=module.silu_and_mul,
        paged_attention=attention,
        is_cpu_kernels=True,
    )


def deterministic_kernel_ops(
    device: torch.device | str, *, use_triton: bool | None = None
) -> KernelOps:
    """The batch-invariant op set of ``model.deterministic``: every query token's attention
    computed as a decode over its own context. On CPU the C++ set with its decode kernel
    (``kernels/batch_invariant.py``); on CUDA (or ``use_triton``, the interpreter in
    tests) the Triton set with the fixed-split decode kernel
    (``kernels/triton_batch_invariant.py``; the model's linears get that module's
    ``linear``: ``workers/models/deterministic.py``).

    Raises ValueError naming what is missing: the C++ module must build on CPU, and other
    devices have no batch-invariant kernels.
    """
    kind = torch.device(device).type
    if use_triton is None:
        use_triton = kind == "cuda"
    if use_triton:
        from kernels import triton_batch_invariant

        return replace(
            triton_kernel_ops(),
            paged_attention=partial(
                batch_invariant.per_token_attention, decode_fn=triton_batch_invariant.decode_fn
            ),
            is_batch_invariant=True,
        )
    if kind != "cpu":
        raise ValueError(
            f"model.deterministic: batch-invariant kernels exist for CPU and CUDA, not {device}"
        )
    decode = cpu_paged_decode.load()
    module = cpu_extension.load()
    if module is None or decode is None:
        raise ValueError(
            "model.deterministic needs the C++ CPU kernels (kernels/cpu_extension.py), which "
            "did not build here (see the log; BATON_CPU_KERNELS=0 turns them off)"
        )
    attention = partial(batch_invariant.per_token_attention, decode_fn=decode)
    return replace(_cpp_ops(module, attention), is_batch_invariant=True)


def get_kernel_ops(device: torch.device | str, *, use_triton: bool | None = None) -> KernelOps:
    """Return the op set for ``device``: Triton on CUDA, ``cpu_kernel_ops`` on CPU, the
    PyTorch references elsewhere.

    Called once at start-up (model loading). ``use_triton`` overrides the choice, e.g. to run
    the references on a GPU for comparison.
    """
    if use_triton is None:
        use_triton = torch.device(device).type == "cuda"
    if use_triton:
        return triton_kernel_ops()
    return cpu_kernel_ops() if torch.device(device).type == "cpu" else REFERENCE_OPS


__all__ = [
    "REFERENCE_OPS",
    "AttentionMetadata",
    "KernelOps",
    "cpu_kernel_ops",
    "deterministic_kernel_ops",
    "get_kernel_ops",
    "triton_kernel_ops",
]
