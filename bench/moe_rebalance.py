"""The expert placement rebalancer on a skewed workload: rank load before and after, and the
step time around a swap.

A random-weight MoE model (``baton make-model --arch qwen3-moe``, 8 experts, top-2) whose
routers are skewed on purpose (``skew_router``: experts 0 and 1, both on rank 0 of an EP=2
replica, scaled up, the others down), served by an EP=2 replica of two gloo ranks with
``expert_rebalance_steps`` / ``expert_redundant``. ``--batch`` requests of ``--prompt-len``
tokens decode ``--steps`` tokens each. Rank 0 records after every forward: its wall time,
whether a swap was under way, and the pairs each rank's expert slots computed (measured per
physical slot, ``ExpertMap.slot_tokens``, summed over the layers). Reported:

- max/mean pairs per rank over the decode steps that ran wholly on the home placement
  (before the first swap) and over those after it (no swap under way);
- median decode step time before and after (and, with ``--check``, of the same steps in a
  run without rebalancing), each swap step's time, and the swap's own share of it
  (``on_step``: planning, one layer's copies moved, the map switched);
- whether the greedy tokens equal the same replica's without rebalancing (``--check``).

    python -m bench.moe_rebalance --size small --json bench/moe_rebalance.json
"""

from __future__ import annotations

import argparse
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

HOT = (0, 1)  # the experts the skewed router favours (rank 0's under EP=2 of 8)


def skew_router(model_dir: Path, hot: tuple[int, ...] = HOT) -> None:
    """Scale every layer's router rows in place: ``hot`` experts by 8, the others by 0.05,
    so that top-2 falls mostly on the hot ones (a router skewed on purpose)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        gate = tensors[name]
        scale = torch.full((gate.shape[0], 1), 0.05, dtype=gate.dtype)
        scale[list(hot)] = 8.0
        tensors[name] = (gate * scale).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _config(args: argparse.Namespace, rebalance: bool):
    from workers.engine.config import EngineConfig

    return EngineConfig(
        model=args.model, dtype="float32", device="cpu", num_kv_blocks=1024,
        max_model_len=512, max_num_seqs=args.batch, max_num_batched_tokens=4096,
        detokenize=False, enable_prefix_caching=False, expert_parallel=2,
        expert_dispatch=args.dispatch, expert_rebalance_steps=args.every if rebalance else 0,
        expert_redundant=args.redundant,
    )  # fmt: skip


def _rank_main(rank: int, port: int, args: argparse.Namespace, rebalance: bool, out: str):
    from workers import SamplingParams
    from workers.engine.llm_engine import LLMEngine
    from workers.models.expert_rebalance import rank_load
    from workers.parallel.replica_follower import RankFollower
    from workers.parallel.replica_kv import ReplicaKV

    torch.set_num_threads(1)
    parallel, link = join_replica(rank, 2, "127.0.0.1", port, "cpu")
    config = _config(args, rebalance)
    try:
        if rank != 0:
            engine = LLMEngine(config, parallel=parallel, agree_num_blocks=agree_min(link))
            RankFollower(engine, link).run()
            return
        kv = ReplicaKV(link)
        engine = LLMEngine(config, parallel=parallel, before_forward=kv.before_forward,
                           agree_num_blocks=agree_min(link))  # fmt: skip
        kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
        runner, rebalancer, trace = engine.runner, engine.runner.rebalancer, []
        run = runner.run

        def traced(inputs, *rest):
            t0 = time.perf_counter()
            logits = run(inputs, *rest)
            seconds = time.perf_counter() - t0
            row = {"s": seconds, "tokens": inputs.num_tokens}
            if rebalancer is not None:
                row["on_step_s"] = swap_s[-1]
                per_rank = [sum(layer) for layer in zip(*rank_load(engine.model), strict=True)]
                row |= {"swaps": rebalancer.num_swaps, "swapping": rebalancer.is_swapping,
                        "started": inputs.expert_rebalance, "per_rank": per_rank}  # fmt: skip
            trace.append(row)
            return logits

        runner.run = traced
        if rebalancer is not None:  # the swap's own cost: planning, copies moved, a switch
            on_step, swap_s = rebalancer.on_step, []

            def timed_on_step(start: bool) -> None:
                t0 = time.perf_counter()
                on_step(start)
                swap_s.append(time.perf_counter() - t0)

            rebalancer.on_step = timed_on_step
        params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
        for i in range(args.batch):
            prompt = [(7 * i + 13 * j) % 1000 + 1 for j in range(args.prompt_len)]
            engine.add_request(prompt, params, f"r{i}")
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(args.batch)}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.token_ids)
        kv.close()
        moved = rebalancer.num_moved if rebalancer is not None else 0
        result = {"trace": trace, "tokens": tokens, "moved": moved}
        Path(out, "result.json").write_text(json.dumps(result))
    finally:
        leave_replica()


def _measure(args: argparse.Namespace, rebalance: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank_main, args=(free_port("127.0.0.1"), args, rebalance, out),
            nprocs=2, join=True, start_method="spawn",
        )  # fmt: skip
        return json.loads(Path(out, "result.json").read_text())


def summarize(trace: list[dict], batch: int) -> dict:
    """Before / after figures of one rebalancing run's trace (module docstring)."""
    from workers.models.eplb_policy import max_over_mean

    pairs = {"before": [0, 0], "after": [0, 0]}
    times: dict[str, list[float]] = {"before": [], "after": [], "swap": [], "moving": []}
    steps: dict[str, list[int]] = {"before": [], "after": []}
    last, was_swapping = [0, 0], False
    for index, row in enumerate(trace):
        delta = [now - was for now, was in zip(row["per_rank"], last, strict=True)]
        last = row["per_rank"]
        # A step moved copies (and switched a layer) when a swap was pending before it or
        # its flag started one; the flag is ignored while a swap is under way.
        if was_swapping or row["started"]:
            times["swap"].append(row["s"])
            times["moving"].append(row["on_step_s"])
        elif row["tokens"] <= batch:  # a decode step (the prefill steps are not compared)
            phase = "before" if row["swaps"] == 0 else "after"
            pairs[phase] = [a + b for a, b in zip(pairs[phase], delta, strict=True)]
            times[phase].append(row["s"])
            steps[phase].append(index)
        was_swapping = row["swapping"]
    return {
        "pairs_per_rank_before": pairs["before"],
        "pairs_per_rank_after": pairs["after"],
        "max_over_mean_before": max_over_mean(pairs["before"]),
        "max_over_mean_after": max_over_mean(pairs["after"]),
        "decode_steps_before": len(times["before"]),
        "decode_steps_after": len(times["after"]),
        "median_decode_step_s_before": statistics.median(times["before"]),
        "median_decode_step_s_after": statistics.median(times["after"]),
        "median_swap_step_s": statistics.median(times["swap"]),
        "max_swap_step_s": max(times["swap"]),
        "median_swap_own_s": statistics.median(times["moving"]),
        "max_swap_own_s": max(times["moving"]),
        "swap_steps": len(times["swap"]),
        "after_step_indices": steps["after"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--every", type=int, default=24, help="expert_rebalance_steps")
    parser.add_argument("--redundant", type=int, default=2, help="expert_redundant")
    parser.add_argument("--dispatch", default="allreduce", choices=("allreduce", "alltoall"))
    parser.add_argument("--check", action="store_true", help="also run without rebalancing")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from cluster.tools.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        args.model = str(make_model(Path(tmp) / "moe", "qwen3-moe", args.size))
        skew_router(Path(args.model))
        load = os.getloadavg()[0]
        run = _measure(args, rebalance=True)
        summary = summarize(run["trace"], args.batch) | {"experts_moved": run["moved"]}
        if args.check:
            plain = _measure(args, rebalance=False)
            summary["tokens_equal_without_rebalancing"] = plain["tokens"] == run["tokens"]
            # The same decode steps (same batch, same tokens) without rebalancing.
            after = summary.pop("after_step_indices")
            summary["median_decode_step_s_after_same_steps_without"] = statistics.median(
                plain["trace"][i]["s"] for i in after
            )
    result = {"command": "python -m bench.moe_rebalance " + " ".join(sys.argv[1:]),
              "loadavg_1min_before": load, "loadavg_1min_after": os.getloadavg()[0],
              "summary": summary, "trace": run["trace"]}  # fmt: skip
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
