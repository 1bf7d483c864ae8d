"""The engine's tiers from its EngineConfig: which ones, their sizes, their fingerprint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.engine.kv_tiers.dir_lock import DirLock
from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.manager import KVTierManager
from workers.engine.kv_tiers.model_digest import model_digest

if TYPE_CHECKING:
    from workers.engine.block_manager import BlockManager
    from workers.engine.config import EngineConfig
    from workers.models.parallel import ParallelContext

logger = logging.getLogger(__name__)

# With a disk tier and no host tier: host memory the disk writer reads behind (at most).
STAGING_BYTES = 256 << 20

# How long a starting tier waits for its directory's lock before it refuses to start: a
# restarted worker's predecessor, killed a moment ago (``ray.kill`` does not wait for the
# process to exit), may still hold it. A real conflict (another cluster on the same path)
# is refused this much later.
LOCK_WAIT_S = 10.0


def tiers_configured(config: EngineConfig) -> bool:
    return config.kv_host_tier_gib > 0 or config.kv_disk_tier_path is not None


def check_single_rank_tiers(config: EngineConfig, parallel: ParallelContext) -> None:
    """Tiers are single-rank: a TP rank's or a pipeline stage's block is a slice of the
    model's KV, and the ranks would have to agree on every offload and onboard."""
    if tiers_configured(config) and (parallel.tp_size > 1 or parallel.pp_size > 1):
        setting = "kv_host_tier_gib" if config.kv_host_tier_gib > 0 else "kv_disk_tier_path"
        raise ValueError(
            f"{setting}: KV tiers are single-rank for now; a replica of tp_size="
            f"{parallel.tp_size}, pp_size={parallel.pp_size} must run without them"
        )


def cache_fingerprint(
    config: EngineConfig,
    kv_cache: torch.Tensor,
    first_layer: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> CacheFingerprint:
    """Whose KV ``kv_cache`` holds: ``[num_blocks, num_layers, 2, kv_heads, block_size, row]``.
    The model is named by its content (``model_digest``) and the quantization its weights
    were loaded with (a quantized model computes other KV than the same checkpoint
    unquantized)."""
    _, num_layers, _, num_kv_heads, block_size, row = kv_cache.shape
    model = model_digest(config.model)
    if config.quantization != "none":
        model += f"+{config.quantization}"
    return CacheFingerprint(
        model=model,
        dtype=str(kv_cache.dtype).removeprefix("torch."),
        kv_cache_dtype=config.kv_cache_dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=row,  # the packed FP8 row is head_dim + 4: the dtype field tells them apart
        block_size=block_size,
        first_layer=first_layer,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def build_kv_tiers(
    config: EngineConfig, kv_cache: torch.Tensor, block_manager: BlockManager
) -> KVTierManager | None:
    """The tier manager for a single-rank engine, or None when no tier is configured (or
    prefix caching is off: tiers find blocks by the prefix cache's hashes)."""
    if not tiers_configured(config):
        return None
    if not config.enable_prefix_caching:
        logger.warning("KV tiers are off: they need enable_prefix_caching (the block hashes)")
        return None
    fingerprint = cache_fingerprint(config, kv_cache)
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    pin = kv_cache.device.type == "cuda"
    host = None
    if config.kv_host_tier_gib > 0:
        host_bytes = int(config.kv_host_tier_gib * 2**30)
        if host_bytes < block_bytes:
            raise ValueError(
                f"kv_host_tier_gib: {config.kv_host_tier_gib} GiB holds no KV block of "
                f"{block_bytes} bytes; raise it or set 0 (off)"
            )
        host = HostTier(fingerprint, block_bytes, host_bytes, pin)
    disk = staging = lock = None
    try:
        if config.kv_disk_tier_path is not None:
            from workers.engine.kv_tiers.disk_tier import DiskTier  # only where a disk is set

            root = Path(config.kv_disk_tier_path)
            # Before the tier scans the directory (it removes temporary files it finds):
            # another process's tier there refuses this one (dir_lock.py).
            lock = DirLock.acquire(root, LOCK_WAIT_S)
            disk_bytes = int(config.kv_disk_tier_gib * 2**30)
            key = read_secret(config.kv_disk_tier_secret_file)
            disk = DiskTier(root, fingerprint, block_bytes, disk_bytes, key=key)
            if host is None:
                staging_bytes = max(block_bytes, min(STAGING_BYTES, disk_bytes))
                staging = HostTier(fingerprint, block_bytes, staging_bytes, pin)
        manager = KVTierManager(
            kv_cache, block_manager, host, disk, staging, disk_lock=lock,
            onboard_mode=config.kv_tier_onboard,
        )  # fmt: skip
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    logger.info(
        "KV tiers: %s (fingerprint %s, %d bytes per block)",
        ", ".join(f"{t.name} {t.stats().capacity_blocks} blocks" for t in (host, disk) if t),
        fingerprint.digest,
        block_bytes,
    )
    return manager


MIN_SECRET_BYTES = 16


def read_secret(path: str | None) -> bytes | None:
    """The disk tier's MAC key from ``kv_disk_tier_secret_file`` (surrounding whitespace
    dropped: a Kubernetes Secret's file often ends in a newline); None when unset."""
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"kv_disk_tier_secret_file: cannot read {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"kv_disk_tier_secret_file: {path} holds {len(secret)} bytes; a secret needs at "
            f"least {MIN_SECRET_BYTES}"
        )
    return secret
