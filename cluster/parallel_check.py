"""Checks of a pool's parallel layout against the model and the Ray cluster, at bring-up.

The config alone cannot tell whether ``tensor_parallel: 4`` suits the model; these
checks read the model's ``config.json`` and the cluster's resources and refuse, with
the key and the numbers, a layout that would fail later inside a worker (a head count
that does not split, more pipeline stages than layers) or never be placed (a stage with
more GPUs than any node has, or more stages than the nodes hold).
"""

from __future__ import annotations

from cluster.config import PoolSection
from workers.models.arch_config import ArchConfig


def check_pool_parallel(
    role: str, pool: PoolSection, arch: ArchConfig, device: str, node_gpus: list[int]
) -> None:
    """Raise ValueError naming ``<role>.tensor_parallel`` (or pipeline_parallel) and why."""
    tp, pp = pool.tensor_parallel, pool.pipeline_parallel
    if pp > arch.num_hidden_layers:
        raise ValueError(
            f"{role}.pipeline_parallel: {pp} stages, but the model has only "
            f"{arch.num_hidden_layers} layers (num_hidden_layers); each stage needs one"
        )
    key = f"{role}.tensor_parallel"
    splits = [
        ("num_attention_heads", arch.num_attention_heads),
        ("intermediate_size", arch.intermediate_size),
        ("shared_expert_intermediate_size", arch.shared_expert_intermediate_size),
    ]
    if arch.num_experts and pool.expert_parallel > 1:  # whole experts per rank (docs/moe.md)
        if arch.num_experts % pool.expert_parallel:
            raise ValueError(
                f"{role}.expert_parallel: {pool.expert_parallel} does not divide the "
                f"model's {arch.num_experts} experts"
            )
        most = arch.num_experts - arch.num_experts // pool.expert_parallel
        if pool.expert_rebalance_steps and pool.expert_redundant > most:
            raise ValueError(
                f"{role}.expert_redundant: {pool.expert_redundant} spare slots per rank, but "
                f"a rank can copy at most the {most} experts it does not hold"
            )
    elif arch.num_experts:  # every expert's intermediate dimension split over the ranks
        splits.append(("moe_intermediate_size", arch.moe_intermediate_size))
    elif pool.expert_parallel > 1:
        raise ValueError(
            f"{role}.expert_parallel: {arch.architecture} has no experts (a dense model); "
            "expert parallelism needs a Mixture-of-Experts model"
        )
    for what, value in splits:
        if value % tp:
            raise ValueError(f"{key}: {tp} does not divide the model's {what} ({value})")
    heads = arch.num_key_value_heads
    if heads % tp and tp % heads:
        raise ValueError(
            f"{key}: {tp} and the model's num_key_value_heads ({heads}) must divide one "
            "another (heads split across ranks, or each head replicated on tp/heads ranks)"
        )
    # A replica's placement group has a bundle per stage (cluster/replicas.py): a stage's
    # TP ranks share a node, and the stages may use several nodes.
    if device != "cuda":
        return
    largest = max(node_gpus, default=0)
    if tp > largest:
        raise ValueError(
            f"{key}: a pipeline stage's {tp} ranks share one node, one GPU each, but the "
            f"largest node has {largest} GPUs"
        )
    stages = sum(gpus // tp for gpus in node_gpus)
    if pp > stages:
        raise ValueError(
            f"{role}.tensor_parallel x pipeline_parallel: a replica's {pp} stages of {tp} "
            f"GPUs each (a stage on one node) do not fit the cluster's nodes "
            f"({', '.join(map(str, node_gpus))} GPUs: room for {stages})"
        )
