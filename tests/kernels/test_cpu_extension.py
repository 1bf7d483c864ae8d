"""Building the C++ CPU module (kernels/cpu_extension.py) when things go wrong: a build
killed midway leaves torch's ``lock`` file behind, and a build held by another process."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock
from torch.utils.cpp_extension import _get_build_directory

from kernels import cpu_extension

ROOT = Path(__file__).resolve().parents[2]


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on():
    assert cpu_extension.load() is not None  # built (and cached) here first
    build_dir = Path(_get_build_directory(cpu_extension.extension_name(), False))
    stale = build_dir / "lock"
    stale.write_text("")  # what a build killed midway leaves
    code = "from kernels import cpu_extension; assert cpu_extension.load() is not None"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, timeout=120, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale.exists()
    assert "left by a build that was killed midway" in done.stderr


def test_a_build_held_elsewhere_past_the_wait_falls_back(tmp_path, monkeypatch, caplog):
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_extension.CSRC, csrc)
    (csrc / "rms_norm.h").write_text((csrc / "rms_norm.h").read_text() + "\n// a copy\n")
    build_dir = Path(_get_build_directory(cpu_extension.extension_name(csrc), False))
    monkeypatch.setattr(cpu_extension, "BUILD_WAIT_S", 0.5)
    held = FileLock(str(build_dir) + ".flock")  # another process building this very module
    with held, caplog.at_level(logging.WARNING, logger="kernels.cpu_extension"):
        assert cpu_extension.load(csrc) is None
    assert "held the build lock" in caplog.text
