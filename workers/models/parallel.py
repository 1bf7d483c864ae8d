"""Parallel context: which rank this worker is and how to reach the others.

Passed explicitly to every parallel layer (no module-level state). At ``tp_size == 1`` the
collectives are no-ops, and at ``pp_size == 1`` there are no stages to pass activations
between, so a single-process model runs without ``torch.distributed``.

A replica has ``tp_size * pp_size`` ranks. **Rank 0 is tensor-parallel rank 0 of the
last pipeline stage**: rank = ``(pp_size - 1 - stage) * tp_size + tp_rank``. Rank 0 runs
the scheduler and the sampler, and the last stage is where the logits are, so the
sampled tokens never travel: the first stage gets the token ids with rank 0's command
(every rank gets every step's inputs), the activations go down the stages, and rank 0
samples from the logits it computed itself. With TP only (``pp_size == 1``) this is the
tensor-parallel numbering that was there before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvtransfer.layout import layer_range
from workers.models.expert_parallel import DpStepTokens
from workers.models.rank_layout import rank_of


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    group: dist.ProcessGroup | None = None  # the stage's TP group; None: the default group
    pp_rank: int = 0  # pipeline stage: 0 embeds the tokens, pp_size - 1 has the LM head
    pp_size: int = 1
    # model.deterministic: all_reduce sums the ranks' parts in rank order, whatever the
    # tensor's size (a ring all-reduce's order per element depends on how it is chunked).
    deterministic: bool = False
    # Mixture-of-Experts layers: whole experts split over the TP ranks (expert_parallel.py)
    # rather than each expert's intermediate dimension; how tokens reach them.
    expert_parallel: bool = False
    expert_dispatch: str = "allreduce"
    # Spare expert slots per rank for the rebalancer (expert_rebalance.py); 0 = off.
    expert_redundant: int = 0
    # Data-parallel attention (workers/parallel/dp_group.py): this engine is rank dp_rank of
    # dp_size, each with its own requests and KV; attention and dense layers are local
    # (tp_size 1), the MoE layers' experts split over the dp_size ranks, whose tokens meet
    # in the dispatcher on dp_group; dp_tokens: the step's token count on each rank.
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    dp_tokens: DpStepTokens | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel rank {self.tp_rank} of size {self.tp_size}")
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"bad pipeline stage {self.pp_rank} of {self.pp_size}")
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"bad data-parallel rank {self.dp_rank} of {self.dp_size}")
        if self.dp_size > 1 and (self.tp_size > 1 or self.pp_size > 1):
            raise ValueError("data-parallel attention runs one rank per engine (no TP, no PP)")

    # ---- expert parallelism --------------------------------------------------------------
    @property
    def ep_size(self) -> int:
        """The ranks a MoE layer's experts are split over (with ``expert_parallel``): the
        data-parallel group's, else the tensor-parallel group's."""
        return self.dp_size if self.dp_size > 1 else self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.dp_rank if self.dp_size > 1 else self.tp_rank

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.dp_group if self.dp_size > 1 else self.group

    # ---- tensor parallelism --------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group, in place; returns ``x``."""
        if self.tp_size > 1 and self.deterministic:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            x.copy_(total)
        elif self.tp_size > 1:
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

    # ---- pipeline parallelism ------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def rank(self) -> int:
        """This rank's index in the replica's process group."""
        return rank_of(self.pp_rank, self.tp_rank, self.tp_size, self.pp_size)

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The model layers ``[start, end)`` this stage runs and keeps KV for."""
        return layer_range(num_layers, self.pp_rank, self.pp_size)

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        """Hand the activations to the same TP rank of the next stage (blocking).

        Every TP rank of a stage holds the same activations (the row-parallel layers
        all-reduced them), so each sends to its peer: no gather, no scatter.
        """
        peer = rank_of(self.pp_rank + 1, self.tp_rank, self.tp_size, self.pp_size)
        dist.send(x.contiguous(), peer)

    def recv_from_prev_stage(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's activations (its ``send_to_next_stage``), of known shape."""
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, rank_of(self.pp_rank - 1, self.tp_rank, self.tp_size, self.pp_size))
        return x


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or ValueError naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size {denominator}")
    return numerator // denominator
