"""A rank that hangs (alive, stopped by SIGSTOP: its connections stay open) mid-decode in
an EP=2 replica of real gloo processes: rank 0's next step raises once the model group's
deadline (``MODEL_GROUP_TIMEOUT_S``, shortened here) passes, instead of waiting out the
bring-up timeout (``GROUP_TIMEOUT_S``, 600 s). A step that raises is what a dead rank
causes too; the worker's answer to it (the replica leaves routing, its requests migrate, it
is restarted) is tests/e2e/test_moe_cluster.py's."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from cluster.tools.make_model import make_model
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.parallel import replica
from workers.parallel.replica import agree_min, free_port, join_replica

DEADLINE_S = 3.0
HANG_AT_STEP = 4


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=model_dir, dtype="float32", device="cpu", max_model_len=128, block_size=8,
        num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, detokenize=False,
        expert_parallel=2, expert_dispatch="alltoall",
    )  # fmt: skip


def _rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    from workers.engine.llm_engine import LLMEngine
    from workers.parallel.replica_follower import RankFollower
    from workers.parallel.replica_kv import ReplicaKV

    torch.set_num_threads(1)
    replica.MODEL_GROUP_TIMEOUT_S = DEADLINE_S
    parallel, link = join_replica(rank, 2, "127.0.0.1", port, "cpu")
    if rank == 1:
        engine = LLMEngine(_config(model_dir), parallel=parallel, agree_num_blocks=agree_min(link))
        run, steps = engine.runner.run, [0]

        def run_then_hang(inputs, *rest):
            steps[0] += 1
            if steps[0] == HANG_AT_STEP:
                os.kill(os.getpid(), signal.SIGSTOP)  # stuck, not dead: sockets stay open
            return run(inputs, *rest)

        engine.runner.run = run_then_hang
        RankFollower(engine, link).run()
        return
    kv = ReplicaKV(link)
    engine = LLMEngine(_config(model_dir), parallel=parallel, before_forward=kv.before_forward,
                       agree_num_blocks=agree_min(link))  # fmt: skip
    kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i in range(3):
        engine.add_request([5 + i, 17, 29, 41], params, f"r{i}")
    num_steps, last_ok = 0, time.monotonic()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            num_steps, last_ok = num_steps + 1, time.monotonic()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    result = {"steps": num_steps, "waited_s": time.monotonic() - last_ok, "error": error}
    Path(out, "rank0.json").write_text(json.dumps(result))
    os._exit(0)  # a clean teardown would wait on the stopped peer; the parent reaps it


def test_a_stopped_rank_fails_the_step_within_the_model_deadline(tmp_path):
    model_dir = str(make_model(tmp_path / "tiny", "qwen3-moe", "tiny"))
    ctx = mp.get_context("spawn")
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank_main, args=(r, port, model_dir, str(tmp_path)))
             for r in (0, 1)]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        procs[0].join(120)
        assert procs[0].exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL ends a stopped process too
            proc.join(10)
    result = json.loads((tmp_path / "rank0.json").read_text())
    # Rank 1 ran steps 1-3 and stopped inside its 4th, so rank 0's 4th step never returns.
    assert result["steps"] == HANG_AT_STEP - 1
    assert "imed out" in result["error"], result["error"]  # gloo: "Timed out waiting ..."
    assert DEADLINE_S <= result["waited_s"] < DEADLINE_S + 10, result
