"""The disk tier does not trust its directory (docs/security.md): private modes, no symlink
followed, a planted FIFO refused without blocking, and with a deployment secret a forged or
copied block refused and counted."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import threading
from pathlib import Path

import pytest
import xxhash

from tests.workers.kv_tiers.test_disk_tier import FILE_BYTES, FP, block, read
from workers.engine.kv_tiers import block_file
from workers.engine.kv_tiers.build import read_secret
from workers.engine.kv_tiers.disk_tier import DiskTier

KEY = b"deployment-secret-0123456789abcdef"
OTHER_KEY = b"another-deployment-secret-0123456789"


def make(root: Path, key: bytes | None = None) -> DiskTier:
    return DiskTier(root, FP, 4096, 8 * FILE_BYTES, key=key)


def path_of(root: Path, block_hash: int) -> Path:
    return root / FP.digest / block_file.file_name(block_hash)


def test_files_are_0600_and_directories_0700(tmp_path: Path) -> None:
    root = tmp_path / "worker"
    root.mkdir(mode=0o755)
    tier = make(root)
    assert tier.put(1, block(1))
    assert stat.S_IMODE(path_of(root, 1).stat().st_mode) == 0o600
    assert stat.S_IMODE((root / FP.digest).stat().st_mode) == 0o700
    assert stat.S_IMODE(root.stat().st_mode) == 0o700  # narrowed: an older run left 0755


def test_a_fifo_planted_under_a_blocks_name_is_refused_without_blocking(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert tier.put(5, block(5))
    path = path_of(tmp_path, 5)
    path.unlink()
    os.mkfifo(path)
    result: list = []
    reader = threading.Thread(target=lambda: result.append(read(tier, 5)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the read blocked on a FIFO"
    assert result == [None]
    assert tier.stats().errors == 1 and not path.exists()  # counted, and removed


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    tier = make(tmp_path)
    assert tier.put(1, block(1)) and tier.put(2, block(2))
    victim = path_of(tmp_path, 2)
    victim.unlink()
    victim.symlink_to(path_of(tmp_path, 1))  # a valid file... of another block
    assert read(tier, 2) is None
    assert tier.stats().errors == 1
    assert path_of(tmp_path, 1).exists()  # the link's target is untouched


def test_a_planted_temporary_file_is_not_written_through(tmp_path: Path) -> None:
    tier = make(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep me")
    temp = path_of(tmp_path, 3).with_name(f".{block_file.file_name(3)}.{os.getpid()}.tmp")
    temp.symlink_to(target)
    assert tier.put(3, block(3))
    assert target.read_bytes() == b"keep me"
    assert read(tier, 3) is not None


def test_with_a_secret_only_this_deployments_blocks_are_read(tmp_path: Path) -> None:
    mine, theirs, plain = tmp_path / "mine", tmp_path / "theirs", tmp_path / "plain"
    tier = make(mine, KEY)
    assert tier.put(1, block(1))
    got = read(tier, 1)
    assert got is not None and bool((got == block(1)).all())
    # A block another deployment (another secret) wrote, copied in: refused.
    other = make(theirs, OTHER_KEY)
    assert other.put(2, block(2))
    shutil.copy(path_of(theirs, 2), path_of(mine, 2))
    # A plain (checksummed) block planted: refused too.
    unkeyed = make(plain)
    assert unkeyed.put(3, block(3))
    shutil.copy(path_of(plain, 3), path_of(mine, 3))
    restarted = make(mine, KEY)  # its scan indexes every file of the right size
    assert read(restarted, 1) is not None
    assert read(restarted, 2) is None and read(restarted, 3) is None
    assert restarted.stats().errors == 2
    # Without the secret, a keyed block cannot be checked: refused, not trusted.
    assert read(make(theirs), 2) is None


def test_a_forged_payload_with_fresh_checksums_is_refused_under_a_secret(tmp_path: Path) -> None:
    tier = make(tmp_path, KEY)
    assert tier.put(7, block(7))
    path = path_of(tmp_path, 7)
    data = bytearray(path.read_bytes())
    data[block_file.HEADER_LEN] ^= 0xFF  # the attacker's KV
    # ... and everything a checksum can fix: flags 0, the payload's xxh3, the header's.
    struct.pack_into("<I", data, 12, 0)
    data[40:56] = xxhash.xxh3_64_digest(bytes(data[block_file.HEADER_LEN :]))[::-1] + bytes(8)
    data[56:64] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:56])))
    forged = bytes(data)
    path.write_bytes(forged)
    assert read(tier, 7) is None and tier.stats().errors == 1
    # The same forgery passes a tier without a secret: what the secret is for.
    plain = tmp_path / "plain"
    unkeyed = make(plain)
    assert unkeyed.put(7, block(8))
    path_of(plain, 7).write_bytes(forged)
    assert read(make(plain), 7) is not None


def test_the_secret_file_is_checked(tmp_path: Path) -> None:
    assert read_secret(None) is None
    good = tmp_path / "secret"
    good.write_bytes(KEY + b"\n")
    assert read_secret(str(good)) == KEY
    short = tmp_path / "short"
    short.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="holds 5 bytes; a secret needs at least 16"):
        read_secret(str(short))
    with pytest.raises(ValueError, match="kv_disk_tier_secret_file: cannot read"):
        read_secret(str(tmp_path / "missing"))
