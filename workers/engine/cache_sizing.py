"""Sizes resolved once at start-up: the longest request and the number of KV-cache blocks."""

from __future__ import annotations

import logging

import torch

from workers.engine.config import EngineConfig
from workers.engine.kv_cache import bytes_per_block
from workers.models.arch_config import ArchConfig

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, arch: ArchConfig) -> int:
    """Longest prompt + output: config.max_model_len, checked against what the model supports."""
    limit, why = arch.max_position_embeddings, "max_position_embeddings"
    # Our attention is full (no sliding window); within the window the two are identical,
    # so a model trained with one (Mistral v0.1) is served up to its window only.
    if arch.sliding_window is not None and arch.sliding_window < limit:
        limit, why = arch.sliding_window, "sliding_window"
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {why}={limit}")
    return config.max_model_len


def resolve_num_blocks(
    config: EngineConfig,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    num_kv_heads: int | None = None,
    num_layers: int | None = None,
    extra_bytes_per_block: int = 0,
) -> int:
    """KV-cache blocks: config.num_kv_blocks, else what the memory budget holds (capped
    where more memory buys nothing). Raises ValueError if one full-length request can't fit.

    ``num_kv_heads``, ``num_layers``: the KV heads and layers this rank keeps (default: all
    of the model's; a pipeline stage keeps its layers only). ``extra_bytes_per_block``: a
    second tensor indexed by the same blocks (a speculative draft model's KV)."""
    per_block = (
        bytes_per_block(
            num_layers or arch.num_hidden_layers,
            num_kv_heads or arch.kv_cache_heads,
            config.block_size,
            arch.kv_cache_head_dim,
            dtype,
            config.kv_cache_dtype,
            arch.kv_cache_entries,
        )
        + extra_bytes_per_block
    )
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = total * config.gpu_memory_fraction - used
        num_blocks = int(budget // per_block)
    else:
        num_blocks = int(config.kv_cache_memory_gib * 2**30 // per_block)
    min_blocks = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is None:
        # More than max_num_seqs full-length requests can never be in use at once; as
        # much again is kept for the prefix cache. Beyond that, memory buys nothing.
        num_blocks = min(num_blocks, 2 * config.max_num_seqs * min_blocks)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV cache of {num_blocks} blocks cannot hold one request of "
            f"max_model_len={max_model_len} tokens ({min_blocks} blocks of "
            f"{config.block_size}); raise the cache size or lower max_model_len"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB)",
        num_blocks,
        config.block_size,
        num_blocks * per_block / 2**20,
    )
    return num_blocks
