"""Checks of a pool's parallel layout against the model and the Ray cluster, at bring-up.

The config alone cannot tell whether ``tensor_parallel: 4`` suits the model; these
checks read the model's ``config.json`` and the cluster's resources and refuse, with
the key and the numbers, a layout that would fail later inside a worker (a head count
that does not split, more pipeline stages than layers) or never be placed (more GPUs per
replica than any node has).
"""

from __future__ import annotations

from cluster.config import PoolSection
from workers.models.arch_config import ArchConfig


def check_pool_parallel(
    role: str, pool: PoolSection, arch: ArchConfig, device: str, gpus_per_node: int
) -> None:
    """Raise ValueError naming ``<role>.tensor_parallel`` (or pipeline_parallel) and why."""
    tp, pp = pool.tensor_parallel, pool.pipeline_parallel
    if pp > arch.num_hidden_layers:
        raise ValueError(
            f"{role}.pipeline_parallel: {pp} stages, but the model has only "
            f"{arch.num_hidden_layers} layers (num_hidden_layers); each stage needs one"
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
    # A replica is one STRICT_PACK placement group (cluster/replicas.py): all its ranks,
    # every stage's, on one node.
    if device == "cuda" and tp * pp > gpus_per_node:
        what = f"{tp} ranks" if pp == 1 else f"{tp} x {pp} ranks (tensor x pipeline)"
        key = key if pp == 1 else f"{role}.tensor_parallel x pipeline_parallel"
        raise ValueError(
            f"{key}: a replica's {what} share one node, one GPU each, but the "
            f"largest node has {gpus_per_node} GPUs"
        )
