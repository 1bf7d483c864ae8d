"""Checks of a pool's parallel layout against the model and the Ray cluster, at bring-up.

The config alone cannot tell whether ``tensor_parallel: 4`` suits the model; these
checks read the model's ``config.json`` and the cluster's resources and refuse, with
the key and the numbers, a layout that would fail later inside a worker (a head count
that does not split) or never be placed (more GPUs per replica than any node has).
"""

from __future__ import annotations

from cluster.config import PoolSection
from workers.models.arch_config import ArchConfig


def check_pool_parallel(
    role: str, pool: PoolSection, arch: ArchConfig, device: str, gpus_per_node: int
) -> None:
    """Raise ValueError naming ``<role>.tensor_parallel`` (or pipeline_parallel) and why."""
    tp = pool.tensor_parallel
    if pool.pipeline_parallel != 1:
        raise ValueError(
            f"{role}.pipeline_parallel: only 1 is supported so far "
            f"(got {pool.pipeline_parallel}); use tensor_parallel to split a model"
        )
    key = f"{role}.tensor_parallel"
    for what, value in (
        ("num_attention_heads", arch.num_attention_heads),
        ("intermediate_size", arch.intermediate_size),
    ):
        if value % tp:
            raise ValueError(f"{key}: {tp} does not divide the model's {what} ({value})")
    heads = arch.num_key_value_heads
    if heads % tp and tp % heads:
        raise ValueError(
            f"{key}: {tp} and the model's num_key_value_heads ({heads}) must divide one "
            "another (heads split across ranks, or each head replicated on tp/heads ranks)"
        )
    if device == "cuda" and tp > gpus_per_node:
        raise ValueError(
            f"{key}: a replica's {tp} ranks share one node, one GPU each, but the "
            f"largest node has {gpus_per_node} GPUs"
        )
