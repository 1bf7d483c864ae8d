"""``model.deterministic`` on a tensor-parallel replica (TP=2, gloo, real processes).

The all-reduce adds the ranks' partial sums in rank order (``ParallelContext``), the
linears and attention are batch-invariant on every rank, so rank 0's logits for a
sequence are bitwise the same whether each prompt ran alone or all ran together with
their prefill chunks interleaved under one small step budget. (TP=1 and TP=2 do not give
the same bits: docs/engine.md, "Deterministic mode".)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cluster.tools.make_model import make_model
from tests.workers.test_deterministic import LogitsSpy
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica
from workers.parallel.replica_follower import RankFollower
from workers.parallel.replica_kv import ReplicaKV

PROMPT_LENGTHS = (5, 19, 45)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _config(model_dir: str, deterministic: bool) -> EngineConfig:
    return EngineConfig(
        model=model_dir, dtype="bfloat16", deterministic=deterministic, device="cpu",
        max_model_len=128, block_size=8, num_kv_blocks=64, max_num_seqs=4,
        max_num_batched_tokens=8, enable_prefix_caching=False, detokenize=False,
    )  # fmt: skip


def _prompts(vocab_size: int) -> list[list[int]]:
    return [
        [(37 * i + 11 * j) % (vocab_size - 1) + 1 for j in range(length)]
        for i, length in enumerate(PROMPT_LENGTHS)
    ]


def _run(engine: LLMEngine, prompts) -> None:
    for prompt in prompts:
        engine.add_request(prompt, PARAMS)
    while engine.has_unfinished_requests():
        engine.step()


def _rank_main(
    rank: int, world: int, port: int, model_dir: str, out_dir: str, deterministic: bool
) -> None:
    torch.set_num_threads(1)
    parallel, link = join_replica(rank, world, "127.0.0.1", port, "cpu")
    try:
        if rank == 0:
            kv = ReplicaKV(link)
            engine = LLMEngine(
                _config(model_dir, deterministic), parallel=parallel, before_forward=kv.before_forward,
                agree_num_blocks=agree_min(link),
            )  # fmt: skip
            kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
            prompts = _prompts(engine.vocab_size)
            spy = LogitsSpy(engine)
            for prompt in prompts:
                _run(engine, [prompt])
            alone, spy.rows = spy.rows, {}
            _run(engine, prompts)
            kv.close()
            together = spy
            rows = [k for k in alone if k in together.rows]
            result = {
                "num_rows": len(together.rows),
                "num_shared": len(rows),
                "num_differing": sum(not torch.equal(alone[k], together.rows[k]) for k in rows),
                "all_reduce_in_rank_order": engine.parallel.deterministic,
            }
        else:
            engine = LLMEngine(
                _config(model_dir, deterministic),
                parallel=parallel,
                agree_num_blocks=agree_min(link),
            )
            RankFollower(engine, link).run()
            result = {}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


@pytest.mark.parametrize("deterministic", [True, False], ids=["mode-on", "mode-off"])
def test_tp2_logits_do_not_depend_on_the_batch(tmp_path, deterministic):
    """And with the mode off they do (bfloat16): the test can tell."""
    model_dir = str(make_model(tmp_path / "tiny", "llama", "tiny"))
    mp.start_processes(
        _rank_main,
        args=(2, free_port("127.0.0.1"), model_dir, str(tmp_path), deterministic),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["all_reduce_in_rank_order"] == deterministic
    if not deterministic:
        # Diverged tokens leave rows unshared; shared ones differ in their bits.
        missing = result["num_rows"] - result["num_shared"]
        assert result["num_differing"] + missing > 0
        return
    assert result["num_rows"] == len(PROMPT_LENGTHS) * PARAMS.max_tokens
    assert result["num_shared"] == result["num_rows"]
    assert result["num_differing"] == 0
