"""Tensor-parallel context: which rank this worker is and how to reach the others.

Passed explicitly to every parallel layer (no module-level state). At ``tp_size == 1`` the
collectives are no-ops, so a single-process model runs without ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (when tp_size > 1)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel rank {self.tp_rank} of size {self.tp_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group, in place; returns ``x``."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def kv_heads(self, total_num_kv_heads: int) -> tuple[int, int]:
        """(KV heads on this rank, which slice of them): heads split across the ranks, or,
        with fewer KV heads than ranks, one head each, shared by ``tp_size // heads`` ranks."""
        if self.tp_size >= total_num_kv_heads:
            replicas = divide(self.tp_size, total_num_kv_heads, "tp_size over num_key_value_heads")
            return 1, self.tp_rank // replicas
        return divide(total_num_kv_heads, self.tp_size, "num_key_value_heads"), self.tp_rank

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order); returns a new tensor."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or ValueError naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size {denominator}")
    return numerator // denominator
