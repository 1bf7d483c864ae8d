"""A full disk below a real engine: offload to the disk tier stops, serving does not.

The disk tier's own reaction to ENOSPC (a rejected put, a pause, reads going on) is
test_disk_tier_failures.py's, the manager's with a fake failing tier test_manager.py's;
this is the engine's whole path with the real DiskTier whose file writes fail, as they do
when the filesystem is full (a real small filesystem needs mount privileges: not in CI)."""

from __future__ import annotations

import errno
import os

import pytest

from tests.workers.kv_tiers.test_tiers_engine import GREEDY, make_llm, prompts
from workers.engine.kv_tiers import block_file
from workers.engine.kv_tiers.dir_lock import LOCK_NAME


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cluster.tools.make_model import make_model

    path = tmp_path_factory.mktemp("tiny")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return path


def test_a_full_disk_rejects_offloads_and_serving_goes_on(model_dir, tmp_path, monkeypatch):
    ps = prompts()
    want = [list(o.token_ids) for o in make_llm(model_dir).generate(ps, GREEDY)]
    attempts: list[int] = []

    def full_disk(fd: int, buffers: list) -> int:
        attempts.append(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(block_file.os, "writev", full_disk)
    # A disk tier and no host tier: the manager's staging buffer feeds the disk writer.
    llm = make_llm(model_dir, kv_disk_tier_path=str(tmp_path), kv_disk_tier_gib=0.01)
    tiers = llm.engine.kv_tiers
    (disk,) = tiers.tiers
    assert disk.name == "disk"
    assert [list(o.token_ids) for o in llm.generate(ps, GREEDY)] == want
    evicted = llm.engine.block_manager.evict()  # all of it goes down: to staging, then disk
    assert evicted > 0
    tiers.wait_idle()
    writer = tiers.stats().writer
    assert writer.submitted == evicted and writer.failed == evicted  # not one written
    stats = disk.stats()
    assert stats.rejected == evicted and stats.blocks == 0 and stats.offload_bytes == 0
    assert len(attempts) == 1  # then paused: the disk is not hammered
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in files] == [LOCK_NAME]  # no block, no temporary file left behind

    # Serving goes on, and what staging holds is still onboarded rather than computed.
    assert [list(o.token_ids) for o in llm.generate(ps, GREEDY)] == want
    assert tiers.stats().onboarded > 0
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0
