"""The engine with a disk tier (G3) on real files: a restarted engine serves a prefix from
the disk with the tokens it would have computed, and a corrupted block file is a miss
(computed instead, same tokens)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.tools.make_model import make_model
from tests.workers.kv_tiers.test_tiers_engine import BLOCK, GREEDY, Counting, make_llm, prompts
from workers.engine.kv_tiers.block_file import HEADER_LEN
from workers.engine.kv_tiers.disk_tier import DiskTier

SHARED_BLOCKS = 29 // BLOCK  # prompts() share 29 tokens


def disk_of(llm) -> DiskTier:
    (disk,) = [t for t in llm.engine.kv_tiers.tiers if t.name == "disk"]
    return disk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return path


def fill_disk(model_dir: Path, root: Path, ps: list[list[int]]) -> tuple[list, int]:
    """A first engine computes the prompts and writes every full block down to disk."""
    llm = make_llm(model_dir, kv_disk_tier_path=str(root))
    outs = [list(o.token_ids) for o in llm.generate(ps, GREEDY)]
    num_cached = llm.engine.block_manager.evict()  # all of it goes down, via staging
    llm.engine.kv_tiers.wait_idle()
    disk = disk_of(llm)
    assert disk.stats().blocks == num_cached > 0
    disk.check_integrity()
    llm.engine.kv_tiers.close()
    return outs, num_cached


@pytest.fixture(scope="module")
def want(model_dir) -> list[list[int]]:
    return [list(o.token_ids) for o in make_llm(model_dir).generate(prompts(), GREEDY)]


def test_a_restarted_engine_serves_the_prefix_from_disk(model_dir, want, tmp_path):
    ps = prompts()
    first, num_cached = fill_disk(model_dir, tmp_path, ps)
    assert first == want

    llm = make_llm(model_dir, kv_disk_tier_path=str(tmp_path))  # the restart
    disk = disk_of(llm)
    assert disk.stats().blocks == num_cached  # found at start
    assert llm.engine.kv_tiers.lookup(ps[0]) == len(ps[0]) // BLOCK  # every full block
    counting = Counting(llm.engine.scheduler)
    outs = llm.generate(ps, GREEDY)
    assert [list(o.token_ids) for o in outs] == want
    for out, p in zip(outs, ps, strict=True):
        full = BLOCK * ((len(p) - 1) // BLOCK)
        assert out.num_cached_tokens == full
        assert counting.computed[out.request_id] == len(p) - full + GREEDY.max_tokens - 1
    stats = llm.engine.kv_tiers.stats()
    expected = sum((len(p) - 1) // BLOCK for p in ps) - SHARED_BLOCKS * (len(ps) - 1)
    assert (stats.onboarded, stats.onboard_failed) == (expected, 0)
    assert disk.stats().hits == expected and disk.stats().errors == 0


def test_a_corrupt_block_on_disk_is_computed_again(model_dir, want, tmp_path):
    ps = prompts()
    fill_disk(model_dir, tmp_path, ps)
    # Damage every file by one payload byte, as bit rot would (the mtime stays).
    directory = next(tmp_path.iterdir())
    files = sorted(directory.iterdir())
    for path in files:
        stat = path.stat()
        data = bytearray(path.read_bytes())
        data[HEADER_LEN + 5] ^= 0x10
        path.write_bytes(bytes(data))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    llm = make_llm(model_dir, kv_disk_tier_path=str(tmp_path))
    disk = disk_of(llm)
    assert disk.stats().blocks == len(files)
    counting = Counting(llm.engine.scheduler)
    outs = llm.generate(ps, GREEDY)
    assert [list(o.token_ids) for o in outs] == want  # never wrong tokens
    # Onboarding stopped at each request's first block (a miss): all computed.
    for out, p in zip(outs, ps, strict=True):
        assert counting.computed[out.request_id] >= len(p) - SHARED_BLOCKS * BLOCK
    stats = llm.engine.kv_tiers.stats()
    assert stats.onboarded == 0 and stats.onboard_failed > 0
    assert disk.stats().errors >= 1 and disk.stats().hits == 0


def test_a_prefix_still_in_the_pool_at_close_is_served_from_disk_after_a_restart(
    model_dir, want, tmp_path
):
    """Offload happens on eviction only: close writes down what the pool still holds."""
    tokens = prompts()[1][:41]  # 5 full blocks before the last token
    llm = make_llm(model_dir, kv_disk_tier_path=str(tmp_path))
    (first,) = llm.generate([tokens], GREEDY)
    assert llm.engine.kv_tiers.stats().offloaded == 0  # nothing left the pool
    committed = len(llm.engine.block_manager.committed_blocks())  # the output's too
    assert committed == (len(tokens) + GREEDY.max_tokens - 1) // BLOCK
    done = llm.engine.kv_tiers.close()
    assert (done.written, done.dropped, done.failed) == (committed, 0, 0)

    llm = make_llm(model_dir, kv_disk_tier_path=str(tmp_path))  # the restart
    counting = Counting(llm.engine.scheduler)
    (again,) = llm.generate([tokens], GREEDY)
    assert list(again.token_ids) == list(first.token_ids)
    assert again.num_cached_tokens == 40
    assert counting.computed[again.request_id] == 1 + GREEDY.max_tokens - 1
    assert llm.engine.kv_tiers.stats().onboarded == 5 == disk_of(llm).stats().hits
    llm.engine.kv_tiers.close()
