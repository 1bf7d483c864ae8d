"""``bench/gpu_check.sh --dry-run``: the one command for a lent GPU, its plumbing on CPU.

Every step runs in its CPU form (the kernel tests in Triton's interpreter, the GPU-marked
tests collected, the kernels compiled for sm_90 without a device, the engine benchmark
on a tiny model) under its own time limit, and the script writes each step's status, the
engine figures as JSON and a summary to $OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_runs_every_step_and_writes_its_results(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == ["setup", "kernels", "engine", "kernel_tests", "gpu_tests"]
    failed = {
        s["step"]: (tmp_path / f"{s['step']}.log").read_text()[-2000:] for s in steps if s["rc"]
    }
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-2000:]
    engine = json.loads((tmp_path / "engine.json").read_text())
    steps_run = {row["step"] for row in engine["rows"]}
    assert {"decode batch 1 x 64", "decode batch 64 x 64", "prefill 48"} <= steps_run
    assert all(row["ms"] > 0 for row in engine["rows"])
    assert "dry_run=1" in (tmp_path / "summary.txt").read_text()
