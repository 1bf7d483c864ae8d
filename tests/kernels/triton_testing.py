"""Shared pieces of the Triton kernel tests (tests/kernels/test_triton_*.py).

The same tests run compiled on a CUDA machine and in Triton's interpreter on CPU
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when there is no CUDA device). Each test module
calls ``require_triton()`` before importing a kernel, so a missing Triton skips with a reason
instead of failing collection.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Compiled on CUDA, interpreted on CPU.
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Triton's interpreter (3.7.1, 3.9.0: ``cast_impl``) truncates float32 -> bfloat16 casts where
# compiled kernels (and PyTorch) round to nearest even: bfloat16 results may differ by an ulp.
IS_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# With ``@pytest.mark.gpu`` on tests that only make sense compiled (large shapes, the engine
# on CUDA): the marker selects them, this skips them on CPU-only machines.
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def require_triton() -> None:
    """Skip the calling test module when Triton cannot be imported."""
    pytest.importorskip(
        "triton",
        reason="triton is not installed (pip install triton); the Triton kernel tests are skipped",
    )


def rounding_tolerance(dtype: torch.dtype, num_roundings: int = 2) -> dict[str, float]:
    """``assert_close`` tolerances for results that may be ``num_roundings`` ulps apart in
    half precision (float32: tight)."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    eps = torch.finfo(dtype).eps
    return {"atol": num_roundings * eps, "rtol": num_roundings * eps}


@contextlib.contextmanager
def _interpreter_dot(dot) -> Iterator[None]:
    """Within the block, the interpreter's ``tl.dot`` is ``dot(builder, a, b, d, original)``
    with bfloat16 operands widened to float32 first (exact, as the GPU's bf16 MMA takes
    them: the interpreter (3.7.1, 3.9.0) would multiply their raw uint16 bits)."""
    if not IS_INTERPRETED:
        yield
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return dot(self, a, b, d, lambda: original(self, a, b, d, input_precision,
                                                   max_num_imprecise_acc))  # fmt: skip

    InterpreterBuilder.create_dot = create_dot
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = original


def bf16_dots_in_interpreter() -> contextlib.AbstractContextManager[None]:
    """Test-only shim: bfloat16 ``tl.dot`` operands widened to float32 in the interpreter
    (see ``_interpreter_dot``); compiled runs are left alone."""
    return _interpreter_dot(lambda builder, a, b, d, original: original())


def position_independent_dots_in_interpreter() -> contextlib.AbstractContextManager[None]:
    """Test-only shim for the batch-invariant kernels: Triton's interpreter computes
    ``tl.dot`` with numpy's ``matmul`` (BLAS), whose rounding for a row depends on where
    the row sits in the tile; a GPU's MMA computes every element of a tile alike. Inside
    this block each element is accumulated along K in order, the same for every position
    (bfloat16 operands widened exactly first), so a test sees what the *kernel* makes a
    row depend on: its tiles, loops and masks. Compiled runs are left alone."""

    def ordered(builder, a, b, d, original):
        import numpy as np
        from triton.runtime.interpreter import TensorHandle

        acc_dtype = d.data.dtype
        lhs, rhs = a.data.astype(acc_dtype), b.data.astype(acc_dtype)
        out = np.zeros(d.data.shape, dtype=acc_dtype)
        for k in range(lhs.shape[-1]):
            out += lhs[..., :, k : k + 1] * rhs[..., k : k + 1, :]
        return TensorHandle(out + d.data, d.dtype.scalar)

    return _interpreter_dot(ordered)
