"""Tenant isolation of cached KV (SamplingParams.cache_salt, workers/protocol/block_hashes.py):
requests with different salts share no block hash, so neither the pool (G1) nor the host
(G2) or disk (G3) tier serves one the other's prefix, and ``num_cached_tokens`` never tells
of it; the same salt shares as before, and no salt is the shared cache of old."""

from __future__ import annotations

import dataclasses

from tests.workers.kv_tiers.test_tiers_engine import (
    BLOCK,
    GREEDY,
    HOST_GIB,
    assert_clean,
    make_llm,
    model_dir,
    prompts,
)
from workers.protocol.block_hashes import NONE_HASH, hash_prompt_blocks, salt_root

__all__ = ["model_dir"]


def salted(salt: str):
    return dataclasses.replace(GREEDY, cache_salt=salt)


def test_different_salts_share_no_block_hash():
    tokens = list(range(64))
    plain = hash_prompt_blocks(tokens, BLOCK)
    a, b = (hash_prompt_blocks(tokens, BLOCK, salt_root(s)) for s in ("a", "b"))
    assert salt_root("") == NONE_HASH and plain == hash_prompt_blocks(tokens, BLOCK, NONE_HASH)
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert a == hash_prompt_blocks(tokens, BLOCK, salt_root("a"))  # stable


def test_no_cross_salt_hit_in_the_pool_or_the_tiers(model_dir, tmp_path):
    (prompt,) = prompts(1)
    full = BLOCK * ((len(prompt) - 1) // BLOCK)
    llm = make_llm(model_dir, kv_host_tier_gib=HOST_GIB, kv_disk_tier_path=str(tmp_path))
    want = llm.generate([prompt], GREEDY)[0].token_ids  # no salt: the shared cache

    def run(salt: str):
        out = llm.generate([prompt], salted(salt))[0]
        assert out.token_ids == want  # the salt changes where KV is found, not the answer
        return out.num_cached_tokens

    # G1: the pool holds the unsalted prompt's blocks, and then tenant a's.
    assert run("tenant-a") == 0
    assert run("tenant-a") == full
    assert run("tenant-b") == 0
    # G2 / G3: the pool forgets; the tiers hold every salt's blocks, each under its own hashes.
    bm = llm.engine.block_manager
    bm.evict()
    tiers = llm.engine.kv_tiers
    for salt in ("tenant-a", "tenant-b"):
        assert tiers.lookup(prompt, salt_root(salt)) == len(prompt) // BLOCK
    assert tiers.lookup(prompt, salt_root("tenant-c")) == 0
    assert run("tenant-c") == 0  # nothing onboarded from anyone else's
    assert run("tenant-a") == full  # its own, onboarded
    assert_clean(llm)
