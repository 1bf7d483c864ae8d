"""SiLU-and-multiply, the gated MLP activation (plain-PyTorch reference).

Layout: ``x`` is [num_tokens, 2 * intermediate_size], the fused ``gate_up_proj`` output
with the gate in the first half and the up projection in the second.
Returns ``silu(gate) * up``: [num_tokens, intermediate_size].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Return ``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
