"""The disk tier's failure cases: a bad file is a miss (counted, logged once, removed, no
exception, the tier keeps working); a full disk stops offload, not reads."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.workers.kv_tiers.test_disk_tier import BLOCK_BYTES, FILE_BYTES, FP, block, make, read
from workers.engine.kv_tiers import block_file
from workers.engine.kv_tiers.block_file import HEADER_LEN
from workers.engine.kv_tiers.disk_tier import DiskTier
from workers.engine.kv_tiers.keys import CacheFingerprint
from workers.engine.kv_tiers.tier import TierEvents

OTHER_FP = CacheFingerprint(
    model="m-2", dtype="float32", kv_cache_dtype="auto", num_layers=2, num_kv_heads=2,
    head_dim=16, block_size=16,
)  # fmt: skip


def path_of(root: Path, block_hash: int, fp: CacheFingerprint = FP) -> Path:
    return root / fp.digest / f"{block_hash:016x}.kvb"


def flip_byte(offset: int) -> Callable[[Path, Path], None]:
    def damage(path: Path, root: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    return damage


def truncate(path: Path, root: Path) -> None:
    os.truncate(path, FILE_BYTES - 100)


def append_byte(path: Path, root: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0")


def zero_length(path: Path, root: Path) -> None:
    path.write_bytes(b"")


def delete(path: Path, root: Path) -> None:
    path.unlink()


def garbage(path: Path, root: Path) -> None:
    path.write_bytes(os.urandom(FILE_BYTES))  # the right size, but not a block file


def other_fingerprint(path: Path, root: Path) -> None:
    # The same hash written by another model's tier (same block size), copied in.
    foreign = make(root, fp=OTHER_FP)
    assert foreign.put(1, block(1))
    shutil.copyfile(path_of(root, 1, OTHER_FP), path)


def other_hash(path: Path, root: Path) -> None:
    # A valid block file of another hash under this hash's name.
    assert make(root).put(2, block(1))
    shutil.copyfile(path_of(root, 2), path)


DAMAGE = {
    "payload_flipped": flip_byte(HEADER_LEN + 1234),
    "last_byte_flipped": flip_byte(FILE_BYTES - 1),
    "header_flipped": flip_byte(33),  # inside the payload length
    "magic_flipped": flip_byte(0),
    "truncated": truncate,
    "one_byte_too_long": append_byte,
    "zero_length": zero_length,
    "missing": delete,
    "garbage": garbage,
    "other_fingerprint": other_fingerprint,
    "other_hash": other_hash,
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_block_is_a_counted_miss_and_the_tier_keeps_working(
    tmp_path: Path, kind: str
) -> None:
    tier = make(tmp_path)
    assert tier.put(1, block(1)) and tier.put(3, block(3))
    tier.drain_events()
    DAMAGE[kind](path_of(tmp_path, 1), tmp_path)

    assert read(tier, 1) is None  # never wrong bytes, never an exception
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.errors) == (0, 1, 1)
    assert not tier.contains(1) and not path_of(tmp_path, 1).exists()
    assert tier.drain_events() == TierEvents(removed=(1,))
    assert read(tier, 1) is None and tier.stats().errors == 1  # now a plain miss
    # The rest of the tier is untouched, and the block can be stored again.
    got = read(tier, 3)
    assert got is not None and torch.equal(got, block(3))
    assert tier.put(1, block(1))
    got = read(tier, 1)
    assert got is not None and torch.equal(got, block(1))


@pytest.mark.parametrize("kind", ["payload_flipped", "garbage", "other_fingerprint"])
def test_damage_found_after_a_restart_is_a_miss_too(tmp_path: Path, kind: str) -> None:
    assert make(tmp_path).put(1, block(1))
    DAMAGE[kind](path_of(tmp_path, 1), tmp_path)
    tier = make(tmp_path)  # the scan reads sizes only: the damage shows on read
    assert tier.contains(1)
    assert read(tier, 1) is None
    assert (tier.stats().misses, tier.stats().errors) == (1, 1)
    assert not path_of(tmp_path, 1).exists()


def test_each_kind_of_damage_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make(tmp_path)
    for h in range(6):
        assert tier.put(h, block(h))
    for h in range(3):
        flip_byte(HEADER_LEN + h)(path_of(tmp_path, h), tmp_path)
    for h in range(3, 6):
        truncate(path_of(tmp_path, h), tmp_path)
    with caplog.at_level(logging.WARNING, logger="workers.engine.kv_tiers.disk_tier"):
        for h in range(6):
            assert read(tier, h) is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert any("corrupt" in m for m in messages) and any("truncated" in m for m in messages)
    assert tier.stats().errors == 6


def test_the_start_scan_removes_what_cannot_be_a_block_and_leaves_other_files(
    tmp_path: Path,
) -> None:
    tier = make(tmp_path)
    assert tier.put(1, block(1)) and tier.put(2, block(2))
    directory = tmp_path / FP.digest
    path_of(tmp_path, 2).write_bytes(b"")  # zero length
    path_of(tmp_path, 3).write_bytes(b"x" * 10)  # wrong size
    leftover = directory / f".{block_file.file_name(4)}.999.tmp"  # an interrupted write
    leftover.write_bytes(b"x" * FILE_BYTES)
    notes = directory / "README.txt"  # not ours to delete
    notes.write_text("hello")

    again = make(tmp_path)
    assert again.hashes() == {1}
    assert again.stats().errors == 2
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [block_file.file_name(1), "README.txt"]
    )
    got = read(again, 1)
    assert got is not None and torch.equal(got, block(1))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_full_disk_stops_offload_for_a_while_and_reads_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, 8 * FILE_BYTES, write_backoff_s=5.0, clock=clock)
    assert tier.put(1, block(1))
    real_writev = os.writev
    attempts = []

    def full_disk(fd: int, buffers: list) -> int:
        attempts.append(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(block_file.os, "writev", full_disk)
    assert not tier.put(2, block(2))
    assert not tier.put(3, block(3))  # paused: not even tried
    assert len(attempts) == 1
    stats = tier.stats()
    assert (stats.rejected, stats.blocks, stats.offload_bytes) == (2, 1, BLOCK_BYTES)
    assert sorted(p.name for p in (tmp_path / FP.digest).iterdir()) == [block_file.file_name(1)]
    got = read(tier, 1)  # serving goes on
    assert got is not None and torch.equal(got, block(1))

    clock.now += 5.0  # the pause is over; the disk is still full: pause twice as long
    assert not tier.put(2, block(2))
    assert len(attempts) == 2
    clock.now += 9.0
    assert not tier.put(2, block(2)) and len(attempts) == 2
    clock.now += 1.0
    monkeypatch.setattr(block_file.os, "writev", real_writev)  # room again
    assert tier.put(2, block(2))
    assert tier.hashes() == {1, 2} and tier.stats().rejected == 4


def test_a_real_enospc_from_the_kernel_is_a_rejected_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /dev/full answers every write with ENOSPC: the block's temporary file opens it. (A
    # symlink planted at the temporary name would not do: it is not followed.)
    tier = make(tmp_path)
    name = block_file.file_name(7)
    temp = tmp_path / FP.digest / f".{name}.{os.getpid()}{block_file.TEMP_SUFFIX}"
    real_open = os.open

    def open_full(path, flags, mode=0o777):
        if str(path) == str(temp):
            return real_open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        return real_open(path, flags, mode)

    monkeypatch.setattr(block_file.os, "open", open_full)
    assert not tier.put(7, block(7))
    monkeypatch.undo()
    assert tier.stats().rejected == 1 and not tier.contains(7)
    assert not temp.exists() and not temp.is_symlink()  # nothing left behind
    assert not path_of(tmp_path, 7).exists()


def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_writev = os.writev

    def short_writev(fd: int, buffers: list) -> int:
        return real_writev(fd, [memoryview(buffers[0])[:1000]])

    monkeypatch.setattr(block_file.os, "writev", short_writev)
    tier = make(tmp_path)
    assert tier.put(1, block(1))
    monkeypatch.undo()
    got = read(tier, 1)
    assert got is not None and torch.equal(got, block(1))


def test_a_read_error_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)
    assert tier.put(1, block(1)) and tier.put(2, block(2))

    def failing_preadv(fd: int, buffers: list, offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(block_file.os, "preadv", failing_preadv)
    assert read(tier, 1) is None
    assert (tier.stats().misses, tier.stats().errors) == (1, 1)
    monkeypatch.undo()
    got = read(tier, 2)
    assert got is not None and torch.equal(got, block(2))


def test_a_directory_removed_behind_the_tier_is_made_again(tmp_path: Path) -> None:
    clock = Clock()
    tier = DiskTier(tmp_path, FP, BLOCK_BYTES, 8 * FILE_BYTES, clock=clock)
    assert tier.put(1, block(1))
    shutil.rmtree(tmp_path / FP.digest)
    assert read(tier, 1) is None and tier.stats().errors == 1
    assert not tier.put(2, block(2)) and tier.stats().rejected == 1
    clock.now += 60
    assert tier.put(2, block(2))
    got = read(tier, 2)
    assert got is not None and torch.equal(got, block(2))
