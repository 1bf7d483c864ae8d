"""One process per disk tier directory (``dir_lock.py``): a second tier on a directory
in use is refused with the directory and the holder's pid, and its scan never runs (the
holder's temporary files stay); the directory is free again after close, and when the
holding process dies."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cluster.tools.make_model import make_model
from workers.engine.block_manager import BlockManager
from workers.engine.config import EngineConfig
from workers.engine.kv_tiers import build as kv_build
from workers.engine.kv_tiers.build import build_kv_tiers
from workers.engine.kv_tiers.dir_lock import LOCK_NAME, DirectoryInUse, DirLock


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return path


def build(model_dir: Path, root: Path):
    kv = torch.zeros((4, 1, 2, 1, 4, 8))  # 256 bytes per block
    config = EngineConfig(model=str(model_dir), kv_disk_tier_path=str(root))
    return build_kv_tiers(config, kv, BlockManager(4, 4))


def test_a_second_tier_on_a_directory_in_use_is_refused(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_build, "LOCK_WAIT_S", 0.0)
    first = build(model_dir, tmp_path)
    (digest_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    in_flight = digest_dir / f".{'0' * 16}.kvb.{os.getpid()}.tmp"  # a write of the holder
    in_flight.write_bytes(b"x")
    with pytest.raises(DirectoryInUse, match=rf"{tmp_path} is in use by pid {os.getpid()}"):
        build(model_dir, tmp_path)
    assert in_flight.exists()  # the refused tier scanned nothing
    first.close()
    second = build(model_dir, tmp_path)  # free again
    assert not in_flight.exists()  # its scan removed the dead write
    second.close()
    assert (tmp_path / LOCK_NAME).is_file()


def hold(directory: Path) -> subprocess.Popen:
    """Another process that takes the directory's lock and keeps it until killed (it keeps
    a reference: a collected DirLock releases, like any FileLock)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from workers.engine.kv_tiers.dir_lock import DirLock; "
            f"lock = DirLock.acquire({str(directory)!r}); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_the_directory_is_free_once_the_holding_process_dies(tmp_path):
    holder = hold(tmp_path)
    try:
        with pytest.raises(DirectoryInUse, match=rf"in use by pid {holder.pid}\b"):
            DirLock.acquire(tmp_path, wait_s=0.3)
    finally:
        holder.kill()  # SIGKILL: no close ran; the kernel drops the lock
        holder.wait()
    lock = DirLock.acquire(tmp_path)
    assert lock.held
    lock.release()
    lock.release()  # idempotent


def test_a_tier_waits_for_a_predecessor_that_is_still_exiting(tmp_path):
    holder = hold(tmp_path)
    killer = threading.Timer(0.5, holder.kill)  # dies while the new one waits
    killer.start()
    try:
        lock = DirLock.acquire(tmp_path, wait_s=60)
    finally:
        killer.join()
        holder.wait()
    assert lock.held
    lock.release()
