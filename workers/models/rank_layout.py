"""How a replica's ranks map onto (pipeline stage, tensor-parallel rank).

Pure integers, no torch: bring-up places the ranks of a replica (Ray placement-group
bundles, one per stage) from the serving driver, which does not load torch.

**Rank 0 is tensor-parallel rank 0 of the last pipeline stage**: rank =
``(pp_size - 1 - stage) * tp_size + tp_rank`` (see `workers/models/parallel.py` for why).
"""

from __future__ import annotations


def rank_of(stage: int, tp_rank: int, tp_size: int, pp_size: int) -> int:
    """The replica rank of (pipeline ``stage``, ``tp_rank``): the last stage holds rank 0."""
    return (pp_size - 1 - stage) * tp_size + tp_rank


def stage_and_tp_rank(rank: int, tp_size: int, pp_size: int) -> tuple[int, int]:
    """Inverse of :func:`rank_of`."""
    if not 0 <= rank < tp_size * pp_size:
        raise ValueError(f"rank {rank} out of range for {tp_size} x {pp_size} ranks")
    return pp_size - 1 - rank // tp_size, rank % tp_size
