"""The C++ decode attention kernel (kernels/csrc/paged_decode.h) against dense attention
written plainly, on odd sizes: GQA ratios 1/4/7, head dims 64/80/128, blocks of 16/32,
ragged lengths across the 256-position chunks it splits and merges, poisoned unowned slots,
a layer view of a whole cache, bfloat16; and the CPU op set that dispatches to it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import REFERENCE_OPS, cpu_extension, cpu_kernel_ops, cpu_paged_decode
from kernels.paged_attention import paged_attention
from tests.kernels.test_paged_attention import HEAD_CONFIGS, dense_reference, make_case

# A required piece of the CPU path: where it fails to build, these tests fail (never skip).
DECODE = cpu_paged_decode.load()


def test_the_kernel_builds_here():
    assert DECODE is not None, "gcc and ninja are dependencies of the CPU path"


@pytest.mark.parametrize("num_kv_heads,ratio", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_dense_attention(num_kv_heads, ratio, head_dim, block_size):
    # Lengths 1, a block boundary, just past one 256-position chunk, several chunks.
    seq_lens = [1, block_size, 257, 700, 33]
    query, cache, tables, metadata = make_case(
        [1] * len(seq_lens), seq_lens, len(seq_lens), num_kv_heads * ratio, num_kv_heads,
        head_dim, block_size, seed=head_dim + block_size,
    )  # fmt: skip
    scale = head_dim**-0.5
    got = DECODE(query, cache, metadata.block_tables, metadata.seq_lens, scale)
    want = dense_reference(query, cache, tables, [1] * len(seq_lens), seq_lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reads_a_layer_view_of_the_whole_cache():
    """The engine passes ``kv_cache[:, layer]``: block stride spans every layer."""
    seq_lens = [300, 5, 64]
    query, cache, _, metadata = make_case([1, 1, 1], seq_lens, 3, 8, 2, 64, 16, seed=3)
    whole = torch.randn(cache.shape[0], 4, *cache.shape[1:])
    whole[:, 2] = cache
    got = DECODE(query, whole[:, 2], metadata.block_tables, metadata.seq_lens, 0.125)
    want = DECODE(query, cache, metadata.block_tables, metadata.seq_lens, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bfloat16_within_its_rounding():
    seq_lens = [40, 600]
    query, cache, tables, metadata = make_case(
        [1, 1], seq_lens, 2, 8, 2, 64, 16, dtype=torch.bfloat16, seed=5
    )
    got = DECODE(query, cache, metadata.block_tables, metadata.seq_lens, 0.125)
    assert got.dtype == torch.bfloat16
    want = dense_reference(query, cache, tables, [1, 1], seq_lens, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_fp8_cache_reads_as_its_dequantized_rows_bitwise(head_dim):
    """Over an FP8 cache the kernel computes what it computes over the float32 cache that
    dequantize_rows makes of it, to the bit: the bit-moving e4m3 conversion is exact for
    every byte (zero, subnormals, +-448, both signs) and the scale multiplies once."""
    from kernels.fp8_kv import dequantize_rows, quantize_rows

    seq_lens = [1, 300, 47]
    query, cache, _, metadata = make_case([1] * 3, seq_lens, 3, 8, 2, head_dim, 16, seed=7)
    fp8 = quantize_rows(cache)
    # Every one of the 256 byte values but the two NaNs somewhere in the cache, with odd scales.
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F]
    flat = fp8.view(-1, head_dim + 4)
    flat[: values.numel() // 2, :2] = values.view(-1, 2)
    flat[:50, head_dim:] = torch.tensor([3.7e-3], dtype=torch.float32).view(torch.uint8)
    got = DECODE(query, fp8, metadata.block_tables, metadata.seq_lens, 0.125)
    want = DECODE(query, dequantize_rows(fp8, torch.float32), metadata.block_tables,
                  metadata.seq_lens, 0.125)  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_the_reference(dtype):
    from kernels.fp8_kv import quantize_rows

    seq_lens = [1, 16, 257, 700, 33]
    query, cache, _, metadata = make_case([1] * 5, seq_lens, 5, 8, 2, 64, 16, dtype=dtype, seed=9)
    fp8 = quantize_rows(cache)
    got = DECODE(query, fp8, metadata.block_tables, metadata.seq_lens, 0.125)
    want = paged_attention(query, fp8, metadata, 0.125)  # the reference: gather, dequantize, bmm
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_refuses_what_it_cannot_read():
    query, cache, _, metadata = make_case([1], [20], 1, 8, 2, 64, 16)
    with pytest.raises(RuntimeError, match="head_dim"):
        DECODE(query[..., :32], cache, metadata.block_tables, metadata.seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        DECODE(query, cache, metadata.block_tables.long(), metadata.seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        DECODE(query.double(), cache, metadata.block_tables, metadata.seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="head_dim \\+ 4"):  # FP8 rows without their scale
        DECODE(query, cache.to(torch.uint8), metadata.block_tables, metadata.seq_lens, 0.1)


def test_the_cpu_op_set_uses_it_for_decodes_and_the_reference_for_the_rest():
    """A mixed batch (decodes then extends) through the CPU op set equals the reference
    op set's output to float rounding, and its decodes are the kernel's own result."""
    ops = cpu_kernel_ops()
    assert ops is not REFERENCE_OPS and not ops.is_triton
    query_lens, seq_lens = [1, 1, 1, 9, 30], [290, 17, 513, 40, 30]
    query, cache, _, metadata = make_case(query_lens, seq_lens, 3, 8, 2, 64, 16, seed=11)
    got = ops.paged_attention(query, cache, metadata, 0.125)
    want = paged_attention(query, cache, metadata, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    own = DECODE(query[:3], cache, metadata.block_tables, metadata.seq_lens, 0.125)
    assert torch.equal(got[:3], own)


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("BATON_CPU_KERNELS", "0")
    cpu_extension.load.cache_clear()
    cpu_paged_decode.load.cache_clear()
    try:
        assert cpu_extension.load() is None and cpu_paged_decode.load() is None
    finally:
        cpu_extension.load.cache_clear()
        cpu_paged_decode.load.cache_clear()


def test_measure_times_both():
    kernel_s, reference_s = cpu_paged_decode.measure(DECODE, repeats=2)
    assert kernel_s > 0 and reference_s > 0


def test_a_build_failure_is_logged_and_falls_back(caplog, tmp_path):
    (tmp_path / "cpu_kernels.cpp").write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_extension"):
        assert cpu_extension.load(tmp_path) is None
    assert "could not be built" in caplog.text


def test_a_second_process_reuses_the_built_kernel():
    """A restart loads the module built before (torch's extension cache) instead of
    compiling again: the shared object is not rewritten."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(cpu_extension.extension_name(), False))
    built = next(build_dir.glob("*.so"))
    before = built.stat().st_mtime_ns
    code = "from kernels import cpu_paged_decode; assert cpu_paged_decode.load() is not None"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)
    assert built.stat().st_mtime_ns == before
