"""Decode steps replayed from captured graphs (workers/engine/decode_graphs.py), on CPU.

A CUDA graph replays the kernels it recorded over the same memory: the step must read its
inputs only from the static buffers, pad its batch to a bucket without touching the KV
cache, and size its launches for any context. The Triton op set in its interpreter reads
lengths and tables from tensors just as the compiled kernels do, so a capture that
"replays" by calling the recorded function again, with no arguments, over the same buffers
checks all of that here; only the driver's recording itself needs the GPU
(``bench/gpu_check.sh`` runs the CUDA test, tests/kernels/test_decode_graphs_cuda.py).
"""

from __future__ import annotations

import logging
import random
from functools import partial

import pytest
import torch

from cluster.tools.make_model import make_model
from kernels import get_kernel_ops
from tests.kernels.triton_testing import IS_INTERPRETED
from workers.engine import decode_graphs, llm_engine
from workers.engine.decode_graphs import DecodeGraphs, graph_batch_sizes
from workers.engine.llm import LLM
from workers.models import loader
from workers.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not IS_INTERPRETED and not torch.cuda.is_available(), reason="Triton needs its interpreter"
)


def call_again(fn):
    """The test capture: a replay calls ``fn`` again, with nothing but the buffers."""
    return fn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("graphs") / "tiny", "llama", "tiny")


def llm_with(model_dir, monkeypatch, max_batch: int, capture=call_again, **kwargs) -> LLM:
    monkeypatch.setattr(loader, "get_kernel_ops", lambda dev: get_kernel_ops(dev, use_triton=True))
    build = partial(decode_graphs.build_decode_graphs, capture=capture)
    monkeypatch.setattr(llm_engine, "build_decode_graphs", build)
    return LLM(
        str(model_dir), dtype="float32", block_size=8, max_num_seqs=8, max_model_len=96,
        num_kv_blocks=64, max_num_batched_tokens=64, cuda_graph_max_batch=max_batch,
        **kwargs,
    )  # fmt: skip


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def generate(llm: LLM, batch: list[list[int]], max_tokens=12) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(batch, params)]


def test_batch_sizes_are_buckets_up_to_the_limit():
    assert graph_batch_sizes(64, 64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(20, 64) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(64, 3) == (1, 2, 3)
    assert graph_batch_sizes(1, 64) == (1,)


def test_replayed_decode_gives_the_eager_tokens(model_dir, monkeypatch):
    """Ragged prompts, 5 at once (bucket 8: three padding rows), then 3 and 1: every
    decode step replays, prefills run eager; tokens equal the eager engine's, and the
    padding rows wrote nothing (a write into a live block would change later tokens)."""
    batches = [prompts(5, 1), prompts(3, 2), prompts(1, 3)]
    eager = llm_with(model_dir, monkeypatch, max_batch=0)
    assert eager.engine.runner.graphs is None
    want = [generate(eager, b) for b in batches]
    llm = llm_with(model_dir, monkeypatch, max_batch=8)
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, DecodeGraphs) and graphs.sizes == (1, 2, 4, 8)
    assert [generate(llm, b) for b in batches] == want
    assert graphs.num_replays >= 3 * 11  # each batch's 11 decode steps, at least
    engine = llm.engine
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0


def test_a_batch_past_the_largest_bucket_runs_eager(model_dir, monkeypatch):
    batch = prompts(6, 4)
    want = generate(llm_with(model_dir, monkeypatch, max_batch=0), batch, 8)
    llm = llm_with(model_dir, monkeypatch, max_batch=4)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == (1, 2, 4)
    seen = []
    takes = graphs.takes

    def spy(inputs):
        took = takes(inputs)
        if inputs.num_decodes == len(inputs.seq_lens):  # decode-only steps
            seen.append((inputs.num_decodes, took))
        return took

    graphs.takes = spy
    assert generate(llm, batch, 8) == want
    assert (6, False) in seen  # six decodes: eager
    assert all(took == (n <= 4) for n, took in seen)


def test_a_failed_capture_leaves_the_engine_eager_with_a_log_line(model_dir, monkeypatch, caplog):
    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    batch = prompts(2, 5)
    want = generate(llm_with(model_dir, monkeypatch, max_batch=0), batch, 6)
    with caplog.at_level(logging.WARNING, logger="workers.engine.decode_graphs"):
        llm = llm_with(model_dir, monkeypatch, max_batch=8, capture=refuse)
    assert llm.engine.runner.graphs is None
    assert "decode graphs off" in caplog.text and "stream is capturing" in caplog.text
    assert generate(llm, batch, 6) == want


def test_prompt_logprobs_and_prefills_do_not_replay(model_dir, monkeypatch):
    """A step with a prefill chunk or prompt-logprob rows is not a plain decode step."""
    llm = llm_with(model_dir, monkeypatch, max_batch=8)
    graphs = llm.engine.runner.graphs
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    llm.generate(prompts(2, 6), params)
    assert graphs.num_replays == 0  # one token each: the prefill samples it, no decode step
