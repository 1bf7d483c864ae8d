"""The cluster config's checks of the KV tiers below each worker's pool (docs/kv-tiers.md):
what ``kv_cache`` may ask of the tiers, refused at load in the YAML's key names."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def check_disk_tier_path(path: str) -> Path:
    """``disk_tier_path`` must be a directory this process can write, or one it can make;
    returns it absolute.

    Checked where the config is loaded (like ``model.path``): on one machine, or on a
    Kubernetes node whose pods mount the same volume, that is where the workers write."""
    root = Path(path).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"disk_tier_path: {root} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"disk_tier_path: cannot create {root}: {exc.strerror}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"disk_tier_path: {root} is not writable")
    return root.resolve()


def check_tiers_single_rank(has_tier: bool, pools: Mapping[str, Any]) -> None:
    """Refuse a tier when a pool (by role) with replicas has more than one rank each.

    A tier holds whole blocks of one rank's cache; a tensor- or pipeline-parallel
    replica's blocks are split over its ranks, which the tiers do not coordinate yet."""
    if not has_tier:
        return
    for role, pool in pools.items():
        if pool.replicas and (pool.tensor_parallel > 1 or pool.pipeline_parallel > 1):
            raise ValueError(
                f"kv_cache: the KV tiers (host_tier_gib, disk_tier_path, peer_sharing) "
                f"need single-rank replicas; {role} has tensor_parallel="
                f"{pool.tensor_parallel}, pipeline_parallel={pool.pipeline_parallel} "
                f"(set both to 1, or turn the tiers off)"
            )
