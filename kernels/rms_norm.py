"""RMSNorm and residual-add + RMSNorm (plain-PyTorch reference).

Layouts: ``x`` and ``residual`` are [..., hidden_size] (usually [num_tokens, hidden_size]
or [num_tokens, num_heads, head_dim] for per-head q/k norms); ``weight`` is [hidden_size].

Numerics follow Hugging Face ``LlamaRMSNorm`` exactly: the mean of squares and the
scaling are computed in float32, the result is cast back to the input dtype, and only
then multiplied by ``weight``.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Return ``weight * x / sqrt(mean(x**2) + eps)`` over the last dim; ``x`` is not mutated."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``; neither input is mutated.

    The second output is the new residual stream of a pre-norm decoder layer.
    """
    hidden = x + residual
    return rms_norm(hidden, weight, eps), hidden
