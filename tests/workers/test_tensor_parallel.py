"""Tensor parallelism across real processes: gloo on CPU, each rank loading its shard.

A replica as the cluster runs it: rank 0's engine schedules and samples and sends each
step's inputs to the other ranks (typed commands, ``workers/replica_*.py``), which run
the same forward pass on their shards; the all-reduces of the row-parallel layers and
the all-gather of the LM head pair up step by step. What must hold: rank 0's greedy
tokens equal the single-process engine's (which tests/workers/test_models.py holds
against transformers), for two architectures, with KV heads split across ranks (TP=2)
and replicated when there are fewer KV heads than ranks (TP=4 on 2 KV heads), through
chunked prefill and decode; every other rank ran exactly one forward pass per step of
rank 0; each rank's KV cache keeps only its own heads, and each rank reads only its
shard of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cluster.tools.make_model import make_model
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.step_inputs import StepInputs
from workers.models import loader
from workers.models.parallel import ParallelContext
from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica
from workers.parallel.replica_follower import RankFollower
from workers.parallel.replica_kv import ReplicaKV

# Lengths around the 32-token step budget and the 8-token blocks: chunked prefill, a
# prompt ending mid-block, and one exactly on a block boundary.
PROMPT_LENGTHS = (5, 16, 45)
MAX_TOKENS = 12


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        dtype="float32",
        device="cpu",
        max_model_len=128,
        block_size=8,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        detokenize=False,
    )


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


def rank0_engine(model_dir: str, parallel, link, record) -> tuple[ReplicaKV, LLMEngine]:
    """Rank 0's replica link and engine; ``record(engine, inputs)`` sees every step it
    sends to the other ranks, before it goes."""
    kv = ReplicaKV(link)

    def send(inputs: StepInputs) -> None:
        record(engine, inputs)
        kv.before_forward(inputs)

    engine = LLMEngine(
        _config(model_dir), parallel=parallel, before_forward=send,
        agree_num_blocks=agree_min(link),
    )  # fmt: skip
    kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
    return kv, engine


def _follow(model_dir: str, parallel, link) -> tuple[LLMEngine, int]:
    """A rank other than 0: build its engine, run rank 0's steps until told to stop;
    (its engine, how many steps it ran)."""
    engine = LLMEngine(_config(model_dir), parallel=parallel, agree_num_blocks=agree_min(link))
    follower = RankFollower(engine, link)
    follower.run()
    return engine, follower.steps


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    parallel, link = join_replica(rank, world, "127.0.0.1", port, "cpu")
    try:
        if rank == 0:
            sent: list[StepInputs] = []
            kv, engine = rank0_engine(model_dir, parallel, link, lambda _, i: sent.append(i))
            tokens = _generate(engine)
            kv.close()
            result = {"tokens": tokens, "steps": len(sent)}
        else:
            engine, steps = _follow(model_dir, parallel, link)
            result = {"steps": steps}
        result["kv_cache_shape"] = list(engine.kv_cache.shape)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(f"tp-{request.param}") / "tiny"
    return str(make_model(path, request.param, "tiny"))


@pytest.fixture(scope="module")
def single_rank(model_dir) -> dict[str, list[int]]:
    return _generate(LLMEngine(_config(model_dir)))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_ranks_match_the_single_process_engine(
    model_dir, single_rank, tp_size, tmp_path
):
    mp.start_processes(
        _rank_main,
        args=(tp_size, free_port("127.0.0.1"), model_dir, str(tmp_path)),
        nprocs=tp_size,
        join=True,
        start_method="spawn",
    )
    total_kv_heads = 2  # the tiny models': 4 attention heads, 2 KV heads
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(tp_size)]
    assert results[0]["tokens"] == single_rank
    assert results[0]["steps"] > len(PROMPT_LENGTHS)
    for rank, result in enumerate(results):
        assert result["steps"] == results[0]["steps"], f"rank {rank} of {tp_size}"
        # (blocks, layers, K/V, heads, block size, head dim): only this rank's heads.
        assert result["kv_cache_shape"][3] == max(1, total_kv_heads // tp_size)
    assert all(len(t) == MAX_TOKENS for t in single_rank.values())


def test_each_rank_reads_only_its_shard_of_the_checkpoint(model_dir, monkeypatch):
    read: list[loader.CheckpointTensor] = []
    iter_tensors = loader._iter_tensors

    def recording(files):
        for name, tensor in iter_tensors(files):
            read.append(tensor)
            yield name, tensor

    monkeypatch.setattr(loader, "_iter_tensors", recording)
    totals = []
    for rank in range(2):
        read.clear()
        # Unpacked: a tied LM head's packed copy would count as a parameter of its own.
        model, _ = loader.load_model(
            model_dir,
            torch.float32,
            torch.device("cpu"),
            ParallelContext(rank, 2),
            pack_linear=False,
        )
        in_file = sum(t.shape.numel() for t in read)
        # Every element read lands in this rank's parameters, and nothing else is read.
        assert sum(t.elements_read for t in read) == sum(p.numel() for p in model.parameters())
        totals.append(sum(t.elements_read for t in read))
    assert all(total < 0.75 * in_file for total in totals), (totals, in_file)
