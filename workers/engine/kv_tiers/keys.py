"""Whose KV a block is: the fingerprint every tier is keyed under besides the block hash.

The chained block hash says which tokens a block covers; two workers serving different
models (or one model in another dtype, KV layout or block size) compute the same hash for
the same tokens, so a tier that outlives one configuration (the disk tier, a peer's host
memory) must also know whose KV it holds. ``CacheFingerprint.digest`` names the disk
tier's directory and is written into every block file's header; peers compare it before
reading each other's host memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheFingerprint:
    model: str  # the model's identity: its config.json and weight files' digest, not a path
    dtype: str  # the cache tensor's element dtype ("float32", "bfloat16", "uint8" for FP8)
    kv_cache_dtype: str  # "auto" | "fp8_e4m3"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    first_layer: int = 0  # a pipeline stage's first layer
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def digest(self) -> str:
        """16 hex characters, stable across processes and runs."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
