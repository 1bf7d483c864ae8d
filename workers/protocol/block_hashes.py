"""Chained prefix-block hashes: what the router and the workers agree a prefix is.

The hash of block i covers the parent's hash and block i's token ids, so equal hashes
mean equal prefixes. It is blake2b (not Python's ``hash``) so that it is stable across
processes and runs: the router compares the hashes that different workers report with
the ones it computes from a prompt.

A request's chain starts at its **root**: ``NONE_HASH``, or the hash of its cache salt
(:func:`salt_root`: the caller's tenant and its ``cache_salt``, router/validation.py). Two
requests with different salts share no block hash, so no cache (the pool, the host and
disk tiers, a peer's) serves one the other's prefix, and ``cached_tokens`` says nothing of
another tenant's prompts (docs/security.md).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

NONE_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: stable across processes and runs."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_root(salt: str) -> int:
    """The root of the chain of a request with cache salt ``salt`` (``NONE_HASH`` for none)."""
    if not salt:
        return NONE_HASH
    digest = hashlib.blake2b(b"baton-cache-salt\0" + salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, root: int = NONE_HASH
) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (router and workers agree on these)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
