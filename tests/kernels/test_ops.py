"""get_kernel_ops hands out the reference ops on CPU, with the C++ module's norms and decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import REFERENCE_OPS, KernelOps, get_kernel_ops
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm


def test_cpu_gets_reference_ops_with_the_cpp_norms_and_decode():
    ops = get_kernel_ops(torch.device("cpu"))
    assert isinstance(ops, KernelOps) and not ops.is_triton and ops.is_cpu_kernels
    # RMSNorm from the C++ module (tests/workers/test_fused_decode.py), the rest references.
    assert ops.rms_norm is not rms_norm and ops.apply_rotary is REFERENCE_OPS.apply_rotary
    # Decode attention through the C++ kernel (tests/kernels/test_cpu_paged_decode.py).
    assert ops.paged_attention.func is paged_attention
    assert ops.paged_attention.keywords["decode_fn"] is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        ops.rms_norm = None  # type: ignore[misc]


def test_kernels_imports_no_other_top_level_folder():
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "kernels"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top = node.module.split(".")[0]
                assert top not in {"workers", "router", "kvtransfer", "cluster", "proto"}, path
