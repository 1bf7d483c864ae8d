"""Decode steps replayed from real CUDA graphs against eager, on a GPU (the CPU tests of
the same path: tests/workers/test_decode_graphs.py). Runs in ``bench/gpu_check.sh``."""

from __future__ import annotations

import pytest

from tests.kernels.test_triton_ops import write_model
from tests.kernels.triton_testing import require_triton, requires_cuda

require_triton()

from tests.workers.test_decode_graphs import generate, prompts  # noqa: E402
from workers import LLM  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_cuda]


def llm(path, max_batch: int, **kwargs) -> LLM:
    return LLM(
        str(path), device="cuda", block_size=16, max_num_seqs=16, max_model_len=512,
        num_kv_blocks=128, max_num_batched_tokens=128, cuda_graph_max_batch=max_batch,
        **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "settings", [{"dtype": "float32"}, {"dtype": "bfloat16", "deterministic": True}]
)
def test_cuda_graphs_give_the_eager_tokens(tmp_path, settings):
    write_model(tmp_path, "llama")
    batches = [prompts(11, 1), prompts(3, 2), prompts(1, 3)]
    eager = llm(tmp_path, 0, **settings)
    assert eager.engine.runner.graphs is None
    want = [generate(eager, b, 24) for b in batches]
    del eager
    graphed = llm(tmp_path, 16, **settings)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.sizes == (1, 2, 4, 8, 16)
    assert [generate(graphed, b, 24) for b in batches] == want
    assert graphs.num_replays >= 3 * 23
    graphed.engine.block_manager.check_integrity()
    assert graphed.engine.block_manager.num_used_blocks == 0
