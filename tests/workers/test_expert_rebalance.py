"""The expert placement rebalancer on a replica of two real gloo ranks (EP=2).

The model's routers are skewed on purpose (``bench.moe_rebalance.skew_router``: experts 0
and 1, both rank 0's, take most pairs). Rank 0 runs the engine and samples; rank 1 follows its step
commands. Requests are running while the spares are filled and the maps switch, layer by
layer. What must hold: every request finishes with the single-process engine's greedy
tokens (float32); both ranks moved the same copies at the same steps; and the busiest
rank's share of the pairs, measured per physical slot, falls after the swap.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from bench.moe_rebalance import skew_router
from cluster.tools.make_model import make_model
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.models.eplb_policy import EMPTY, max_over_mean
from workers.models.expert_rebalance import rank_load
from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica
from workers.parallel.replica_follower import RankFollower
from workers.parallel.replica_kv import ReplicaKV

PROMPT_LENGTHS = (5, 16, 45, 9)
MAX_TOKENS = 16
EVERY_STEPS = 4


def _config(
    model_dir: str, expert_parallel: int = 1, every_steps: int = 0, kind: str = "allreduce"
) -> EngineConfig:
    return EngineConfig(
        model=model_dir, dtype="float32", device="cpu", max_model_len=128, block_size=8,
        num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, detokenize=False,
        expert_parallel=expert_parallel, expert_rebalance_steps=every_steps, expert_redundant=2,
        expert_dispatch=kind,
    )  # fmt: skip


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = [(37 * i + 11 * j) % (engine.vocab_size - 1) + 1 for j in range(length)]
        engine.add_request(prompt, params, f"r{i}")
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPT_LENGTHS))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return tokens


def _trace(engine: LLMEngine) -> list[tuple[int, bool, list[int]]]:
    """After each forward: (swaps done, a swap under way, pairs per rank so far)."""
    runner, rebalancer, trace = engine.runner, engine.runner.rebalancer, []
    run = runner.run

    def traced(inputs, *args):
        out = run(inputs, *args)
        per_rank = [sum(layer) for layer in zip(*rank_load(engine.model), strict=True)]
        trace.append((rebalancer.num_swaps, rebalancer.is_swapping, per_rank))
        return out

    runner.run = traced
    return trace


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str, kind: str) -> None:
    torch.set_num_threads(1)
    parallel, link = join_replica(rank, world, "127.0.0.1", port, "cpu")
    config = _config(model_dir, world, EVERY_STEPS, kind)
    try:
        if rank == 0:
            kv = ReplicaKV(link)
            engine = LLMEngine(config, parallel=parallel, before_forward=kv.before_forward,
                               agree_num_blocks=agree_min(link))  # fmt: skip
            kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
            trace = _trace(engine)
            result = {"tokens": _generate(engine), "trace": trace}
            kv.close()
        else:
            engine = LLMEngine(config, parallel=parallel, agree_num_blocks=agree_min(link))
            follower = RankFollower(engine, link)
            follower.run()
            result = {"steps": follower.steps}
        rebalancer = engine.runner.rebalancer
        result |= {"swaps": rebalancer.num_swaps, "moved": rebalancer.num_moved}
        result["spares"] = [b.expert_map.plan.spares for b in rebalancer.blocks]
        result["pairs"] = [b.expert_tokens.tolist() for b in rebalancer.blocks]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


def phase_loads(trace) -> tuple[list[int], list[int]]:
    """Pairs per rank over the steps that ran wholly on the home placement, and over the
    steps after the first swap completed (no swap under way)."""
    totals = {"before": [0, 0], "after": [0, 0]}
    last = [0, 0]
    for swaps, swapping, per_rank in trace:
        delta = [now - was for now, was in zip(per_rank, last, strict=True)]
        last = per_rank
        if not swapping:
            phase = totals["before" if swaps == 0 else "after"]
            phase[:] = [a + b for a, b in zip(phase, delta, strict=True)]
    return totals["before"], totals["after"]


@pytest.fixture(scope="module")
def skewed_model(tmp_path_factory) -> tuple[str, dict[str, list[int]]]:
    path = make_model(tmp_path_factory.mktemp("eplb") / "tiny", "qwen3-moe", "tiny")
    skew_router(Path(path))
    return str(path), _generate(LLMEngine(_config(str(path))))


@pytest.mark.parametrize("kind", ["allreduce", "alltoall"])
def test_a_swap_under_load_balances_the_ranks_and_changes_no_token(skewed_model, kind, tmp_path):
    model_dir, want = skewed_model
    mp.start_processes(
        _rank_main,
        args=(2, free_port("127.0.0.1"), model_dir, str(tmp_path), kind),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    lead = json.loads((tmp_path / "rank0.json").read_text())
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert lead["tokens"] == want  # every request, running across the swaps, unchanged
    assert follower["steps"] == len(lead["trace"])
    # The first swap moved copies into rank 1's spares (from rank 0: the hot experts are
    # 0 and 1), and both ranks ended on the same maps after the same number of swaps.
    assert lead["moved"] == follower["moved"] > 0
    assert lead["swaps"] == follower["swaps"] >= 2  # later plans ran too (and moved nothing new)
    assert lead["spares"] == follower["spares"]
    assert all(set(layer[1]) <= {EMPTY, 0, 1, 2, 3} for layer in lead["spares"])
    assert all(0 in layer[1] for layer in lead["spares"])  # the hottest expert, copied
    # Requests ran while the layers switched one per step: some step saw a swap under way.
    assert any(swapping for _, swapping, _ in lead["trace"])
    before, after = phase_loads(lead["trace"])
    print(
        f"max/mean per rank: before {max_over_mean(before):.3f}, after {max_over_mean(after):.3f}"
    )
    assert max_over_mean(before) > 1.3  # the skew is real (measured 1.39: 219 vs 97 pairs)
    assert max_over_mean(after) < 1.1  # measured 1.00
