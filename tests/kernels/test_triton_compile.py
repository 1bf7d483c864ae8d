"""Every Triton kernel compiles for sm_90 (H100/H200) with its launcher's CUDA configuration,
and the bfloat16 ones keep their registers (no spills) — checked without a GPU.

The interpreter runs kernels as NumPy and never invokes Triton's compiler, so this is what
catches a kernel that would fail to compile, or spill, on the GPU. It runs
``python -m bench.gpu_kernels --compile-only`` in a subprocess (the kernels must be decorated without
``TRITON_INTERPRET``), which uses Triton's bundled ``ptxas`` and ``cuobjdump``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from tests.kernels.triton_testing import require_triton

require_triton()

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED_MEMORY_PER_BLOCK = 227 * 1024  # sm_90's opt-in maximum


def test_kernels_compile_for_sm90_and_bf16_does_not_spill():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_kernels", "--compile-only", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    kernels = {(kernel, dtype) for kernel, dtype, *_ in rows}
    for kernel in ("decode", "decode reduce", "prefill", "store_kv", "fused_add_rms_norm"):
        assert {(kernel, "bf16"), (kernel, "fp32")} <= kernels, kernel
    assert {("rotary", "bf16"), ("silu_and_mul", "bf16"), ("int4_linear", "bf16")} <= kernels
    assert {("moe gate_up + silu", "bf16"), ("moe down", "bf16")} <= kernels
    assert {("mla decode", "bf16"), ("mla decode", "fp32")} <= kernels
    # The FP8 KV cache's variants (packed uint8 rows, IS_FP8) compile too, with bf16 queries.
    fp8 = {kernel for kernel, dtype, config, *_ in rows if "fp8-kv" in config and dtype == "bf16"}
    assert fp8 == {"decode", "prefill", "store_kv"}, fp8
    for kernel, dtype, config, registers, spilled, shared in rows:
        assert int(shared) <= SHARED_MEMORY_PER_BLOCK, (kernel, dtype, config, shared)
        if dtype == "bf16":
            assert int(spilled) == 0, (kernel, config, registers, spilled)
