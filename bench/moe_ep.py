"""Expert parallelism on CPU: one process holding every expert against two ranks of half.

A MoE model (``baton make-model --arch qwen3-moe --size small``: 8 experts, top-2), float32,
``--batch`` requests decoding ``--steps`` tokens each after a 128-token prompt; decode
tokens/s from the moment every request has its first token. Setups, each in fresh
processes, in an order that alternates between repeats:

- ``single``: one process, the whole model, ``--threads`` math threads;
- ``tp2``: a TP=2 replica (two processes of ``--threads / 2`` threads), every expert's
  intermediate dimension split over the ranks, one all-reduce per MoE layer;
- ``ep2-allreduce`` / ``ep2-alltoall``: an EP=2 replica, half of the experts per rank,
  tokens dispatched by ``expert_dispatch``.

Rank 0 measures; in the parallel setups it also times the dispatcher's calls (the whole
call, the rank's own experts included, and the experts alone), so the share of a decode
step spent moving tokens and results between ranks is ``(dispatch - experts) / step``.

    python -m bench.moe_ep --model /tmp/moe-small --json bench/moe_ep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica

SETUPS = ("single", "tp2", "ep2-allreduce", "ep2-alltoall")


def _config(args: argparse.Namespace, setup: str):
    from workers.engine.config import EngineConfig

    config = EngineConfig(
        model=args.model, dtype="float32", device="cpu", num_kv_blocks=2048,
        max_model_len=1024, max_num_seqs=args.batch, max_num_batched_tokens=4096,
        detokenize=False, enable_prefix_caching=False,
    )  # fmt: skip
    if setup.startswith("ep2"):
        config = dataclasses.replace(
            config, expert_parallel=2, expert_dispatch=setup.removeprefix("ep2-")
        )
    return config


def _decode(engine, batch: int, steps: int) -> tuple[float, int]:
    """(decode tokens/s once every request has its first token, decode steps timed)."""
    from workers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(128)], params, f"r{i}")
    started: set[str] = set()
    t0, num_steps = None, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            started.add(delta.request_id)
        if t0 is not None:
            num_steps += 1
        if t0 is None and len(started) == batch:
            t0 = time.perf_counter()
            _Timer.reset()
    assert t0 is not None
    return batch * steps / (time.perf_counter() - t0), num_steps


class _Timer:
    """Seconds inside the dispatchers' calls and inside the local experts, since reset."""

    dispatch = experts = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.dispatch = cls.experts = 0.0

    @classmethod
    def install(cls) -> None:
        from workers.models import expert_parallel as ep

        for kind in (ep.AllReduceDispatch, ep.AllToAllDispatch):
            call = kind.__call__

            def timed(self, hidden, weights, ids, experts, call=call):
                def local(*a):
                    t = time.perf_counter()
                    try:
                        return experts(*a)
                    finally:
                        cls.experts += time.perf_counter() - t

                t0 = time.perf_counter()
                try:
                    return call(self, hidden, weights, ids, local)
                finally:
                    cls.dispatch += time.perf_counter() - t0

            kind.__call__ = timed


def _rank_main(rank: int, setup: str, port: int, args: argparse.Namespace, out: str) -> None:
    from workers.engine.llm_engine import LLMEngine
    from workers.parallel.replica_follower import RankFollower
    from workers.parallel.replica_kv import ReplicaKV

    torch.set_num_threads(max(1, args.threads // 2))
    parallel, link = join_replica(rank, 2, "127.0.0.1", port, "cpu")
    config = _config(args, setup)
    _Timer.install()
    try:
        if rank != 0:
            RankFollower(
                LLMEngine(config, parallel=parallel, agree_num_blocks=agree_min(link)), link
            ).run()
            return
        kv = ReplicaKV(link)
        engine = LLMEngine(
            config, parallel=parallel, before_forward=kv.before_forward,
            agree_num_blocks=agree_min(link),
        )  # fmt: skip
        kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
        rate, steps = _decode(engine, args.batch, args.steps)
        elapsed = args.batch * args.steps / rate
        kv.close()
        result = {"rate": rate, "steps": steps, "dispatch_s": _Timer.dispatch,
                  "experts_s": _Timer.experts, "decode_s": elapsed}  # fmt: skip
        Path(out, "rate.json").write_text(json.dumps(result))
    finally:
        leave_replica()


def _single_main(_: int, args: argparse.Namespace, out: str) -> None:
    from workers.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    rate, steps = _decode(LLMEngine(_config(args, "single")), args.batch, args.steps)
    Path(out, "rate.json").write_text(json.dumps({"rate": rate, "steps": steps}))


def _measure(setup: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        if setup == "single":
            mp.start_processes(_single_main, args=(args, out),
                               nprocs=1, join=True, start_method="spawn")  # fmt: skip
        else:
            mp.start_processes(
                _rank_main, args=(setup, free_port("127.0.0.1"), args, out),
                nprocs=2, join=True, start_method="spawn",
            )  # fmt: skip
        return json.loads(Path(out, "rate.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a MoE model directory")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    setups = args.setups.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    loads = []
    for repeat in range(args.repeats):
        for setup in setups if repeat % 2 == 0 else setups[::-1]:
            loads.append(os.getloadavg()[0])
            runs[setup].append(_measure(setup, args))
            print(f"repeat {repeat + 1}: {setup}: {runs[setup][-1]['rate']:.1f} tok/s", flush=True)
    summary = {}
    for setup, results in runs.items():
        row = {"median_tokens_per_s": statistics.median(r["rate"] for r in results)}
        if "dispatch_s" in results[0]:
            row["dispatch_share_of_decode"] = statistics.median(
                (r["dispatch_s"] - r["experts_s"]) / r["decode_s"] for r in results
            )
            row["moe_layers_share_of_decode"] = statistics.median(
                r["dispatch_s"] / r["decode_s"] for r in results
            )
        summary[setup] = row
    if "single" in summary:
        for setup in setups:
            summary[setup]["vs_single"] = (
                summary[setup]["median_tokens_per_s"] / summary["single"]["median_tokens_per_s"]
            )
    result = {"command": "python -m bench.moe_ep " + " ".join(sys.argv[1:]),
              "batch": args.batch, "steps": args.steps, "threads": args.threads,
              "loadavg_1min_before_each_run": loads, "runs": runs, "summary": summary}  # fmt: skip
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
