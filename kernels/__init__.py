"""Model-side compute ops, chosen once per device and passed to the model.

``get_kernel_ops(device)`` returns a ``KernelOps``; the model holds it and calls through it,
so dispatch happens at start-up, never per call. Every op has a plain-PyTorch reference
(the CPU path); Triton versions for CUDA are checked against those references.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.activation import silu_and_mul
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_store import store_kv
from kernels.paged_attention import paged_attention
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary


@dataclass(frozen=True)
class KernelOps:
    """The op set a model runs with; see each op's module for layouts."""

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


REFERENCE_OPS = KernelOps(
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    silu_and_mul=silu_and_mul,
    store_kv=store_kv,
    paged_attention=paged_attention,
)


def get_kernel_ops(device: torch.device) -> KernelOps:
    """Return the op set for ``device``: the PyTorch references for now (Triton on CUDA later)."""
    del device  # every device uses the references until the Triton ops land
    return REFERENCE_OPS


__all__ = ["AttentionMetadata", "KernelOps", "get_kernel_ops"]
