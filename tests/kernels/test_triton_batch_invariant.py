"""The batch-invariant Triton kernels of ``model.deterministic`` on CUDA
(kernels/triton_batch_invariant.py), in Triton's interpreter here, compiled on a GPU.

The fixed-tile linear equals ``F.linear`` to rounding and gives each row the same bits
whatever rows share its launch; the fixed-split decode attention gives each query token
the same bits however its sequence is chunked or batched, across several context splits,
and equals dense attention to rounding; and the engine built on the Triton op set in this
mode gives a sequence's logits bitwise alike alone and batched with chunked prefills.

In the interpreter ``tl.dot`` is numpy's BLAS, whose rounding for a row depends on its
position within a tile (a GPU's MMA treats every element alike): the tests run under
``position_independent_dots_in_interpreter``, so they check what the kernels make a row
depend on (tiles, loops, splits, masks). On a GPU they run compiled, shim-free.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.triton_testing import (
    DEVICE,
    IS_INTERPRETED,
    position_independent_dots_in_interpreter,
    require_triton,
    rounding_tolerance,
)

require_triton()

from cluster.tools.make_model import make_model  # noqa: E402
from kernels import deterministic_kernel_ops  # noqa: E402
from kernels.batch_invariant import invariance_failures, per_token_attention  # noqa: E402
from kernels.triton_batch_invariant import SPLIT_TOKENS, decode_fn, linear  # noqa: E402
from tests.kernels.paged_batch import build_metadata  # noqa: E402
from tests.kernels.test_paged_attention import dense_reference  # noqa: E402


def test_the_op_set():
    ops = deterministic_kernel_ops(DEVICE, use_triton=True)
    assert ops.is_triton and ops.is_batch_invariant and not ops.is_cpu_kernels
    assert ops.paged_attention.func is per_token_attention
    assert ops.paged_attention.keywords["decode_fn"] is decode_fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features,bias", [(96, 80, False), (200, 130, True)])
def test_linear_matches_f_linear_and_its_rows_do_not_depend_on_the_batch(
    dtype, in_features, out_features, bias
):
    gen = torch.Generator().manual_seed(in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).to(dtype).to(DEVICE)
    b = torch.randn(out_features, generator=gen).to(dtype).to(DEVICE) if bias else None
    x = torch.randn(70, in_features, generator=gen).to(dtype).to(DEVICE)
    with position_independent_dots_in_interpreter():
        got = linear(x, weight, b)
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        torch.testing.assert_close(got.float(), want, **rounding_tolerance(dtype, 4))
        # 1..70 rows at offsets 0 and 3, against the whole batch: bitwise.
        assert invariance_failures(linear, weight, in_features, dtype, b) == []


def test_int4_linear_with_a_fixed_tile_height_does_not_depend_on_the_batch():
    import dataclasses

    from kernels import triton_batch_invariant, triton_int4_linear

    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (96, 128), generator=gen, dtype=torch.uint8)
    scales = torch.rand(96, 4, generator=gen) * 0.02
    zeros = torch.full((96, 4), 8.0)
    packed, matmul = triton_int4_linear.pack(q.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), 32)
    # The fixed tile height matters on a GPU (the MMA layout follows it); in the
    # interpreter this checks the kernel's K loop and masks keep a row to itself.
    fixed = dataclasses.replace(matmul, block_m=triton_batch_invariant.BLOCK_M)
    with position_independent_dots_in_interpreter():
        assert invariance_failures(fixed, packed, 128, torch.float32) == []


def _case(seq_len, other_len, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    block_size, num_kv_heads, num_heads, head_dim = 16, 2, 4, 32
    need = -(-seq_len // block_size) + -(-other_len // block_size)
    perm = torch.randperm(need + 2, generator=gen).tolist()
    table = perm[: -(-seq_len // block_size)]
    other = perm[len(table) : need]
    cache = torch.randn(need + 2, 2, num_kv_heads, block_size, head_dim, generator=gen)
    query = torch.randn(seq_len, num_heads, head_dim, generator=gen)
    other_q = torch.randn(1, num_heads, head_dim, generator=gen)
    move = {"dtype": dtype, "device": DEVICE}
    return cache.to(**move), table, other, query.to(**move), other_q.to(**move), block_size


@pytest.mark.parametrize(
    "dtype,cuts",
    [
        (torch.float32, (1, 255, 300)),
        (torch.bfloat16, (40, 257, 300)),
        pytest.param(torch.float32, (300,), marks=pytest.mark.slow),  # ~30 s interpreted
        pytest.param(torch.bfloat16, (1, 255, 300), marks=pytest.mark.slow),
    ],
)
def test_attention_does_not_depend_on_chunking_or_batch(dtype, cuts):
    """300 positions: two context splits of ``SPLIT_TOKENS``; chunks cut across them,
    alone or after a neighbour's decode of 600 positions (three splits)."""
    assert SPLIT_TOKENS < 300 < 2 * SPLIT_TOKENS
    seq_len, other_len = 300, 600
    cache, table, other, query, other_q, bs = _case(seq_len, other_len, dtype, seed=len(cuts))
    op = deterministic_kernel_ops(DEVICE, use_triton=True).paged_attention
    scale = 32**-0.5
    with position_independent_dots_in_interpreter():
        # Every position as a decode of its own, all in one batch.
        tables = [table] * seq_len
        alone = op(
            query, cache, build_metadata([1] * seq_len, list(range(1, seq_len + 1)), tables, bs,
                                         seq_len, device=DEVICE), scale,
        )  # fmt: skip
        start = 0
        for end in cuts:
            q = torch.cat([other_q, query[start:end]])
            meta = build_metadata(
                [1, end - start], [other_len, end], [other, table], bs, 1, device=DEVICE
            )
            out = op(q, cache, meta, scale)
            assert torch.equal(out[1:], alone[start:end]), (start, end)
            start = end
    want = dense_reference(query.cpu(), cache.cpu(), [table], [seq_len], [seq_len], scale)
    torch.testing.assert_close(alone.float().cpu(), want, **rounding_tolerance(dtype, 8))


@pytest.mark.skipif(not IS_INTERPRETED, reason="Triton on CPU tensors needs the interpreter")
def test_engine_logits_alone_equal_batched(tmp_path, monkeypatch):
    """The engine on the Triton op set with the mode on (float32, interpreter): every
    sampled row of a sequence alone equals its row batched with others under a 13-token
    step budget (chunked prefills beside decodes)."""
    from tests.workers.test_deterministic import LogitsSpy
    from workers import LLM, SamplingParams
    from workers.models import loader

    monkeypatch.setattr(
        loader,
        "deterministic_kernel_ops",
        lambda dev: deterministic_kernel_ops(dev, use_triton=True),
    )
    make_model(tmp_path, "llama", "tiny", overwrite=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in (4, 21, 37)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    args = dict(dtype="float32", deterministic=True, block_size=16, max_num_seqs=8,
                max_model_len=128, num_kv_blocks=64, enable_prefix_caching=False)  # fmt: skip
    with position_independent_dots_in_interpreter():  # the load-time probe too
        alone_llm = LLM(str(tmp_path), max_num_batched_tokens=64, **args)
        assert alone_llm.engine.model.model.layers[0].mlp.ops.is_triton
        alone = LogitsSpy(alone_llm.engine)
        for p in prompts:
            alone_llm.generate([p], params)
        batched_llm = LLM(str(tmp_path), max_num_batched_tokens=13, **args)
        batched = LogitsSpy(batched_llm.engine)
        batched_llm.generate(prompts, params)
    assert len(alone.rows) == len(prompts) * params.max_tokens
    assert set(alone.rows) == set(batched.rows)
    assert all(torch.equal(v, batched.rows[k]) for k, v in alone.rows.items())
