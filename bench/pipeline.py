"""Pipeline parallelism on CPU: batches in flight against stages in turn.

A ``small`` Llama-shaped model (``baton make-model --size small``), float32, one thread
per process, each setup in fresh processes, ``--repeats`` times in turn. Two workloads:

- ``--workload decode`` (default): ``--batch`` requests decoding ``--steps`` tokens each
  after a 256-token prompt; decode tokens/s;
- ``--workload prefill``: lone prompts of ``--prompt-len`` tokens, one at a time, in
  chunks of ``--chunk`` tokens (the token budget), after one unmeasured warm-up prompt;
  the median time to first token over ``--prompts`` prompts. With batches in flight a
  prompt's next chunk enters stage 0 while the previous one is in stage 1.

The setups:

- ``single``: one process, the whole model (the reference);
- ``pp2-in-turn``: a TP=1 x PP=2 replica (two processes) with one batch at a time, so
  each stage waits while the other computes (``batches_in_flight=1``);
- ``pp2-in-flight``: the same replica with one batch per stage in flight (the default);
- ``pp2-handoffs``: ``pp2-in-flight`` while KV hand-offs are open on both ranks, as in
  a disaggregated prefill pool: every 2nd step rank 0 offers a request's blocks on both
  ranks, and declines them (the decode side's notice) 4 steps later, so a lease is
  always open on rank 1 and rank 0 takes in its news. The connectors only keep the
  leases' books (no data moves; what is measured is what the news costs the engine).

Reported per setup (medians over the repeats): decode tokens/s from the moment every
request has its first token to the last one's end, or the time to first token; and
ratios against ``single`` and ``pp2-in-turn`` (speed-ups: > 1 is better). Rank 0 (the
last stage) measures.

    python -m bench.pipeline --model /tmp/small --json bench/pipeline.json
    python -m bench.pipeline --model /tmp/small --workload prefill \
        --setups single,pp2-in-turn,pp2-in-flight --json bench/pipeline_prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica


def _config(args: argparse.Namespace):
    from workers.engine.config import EngineConfig

    prefill = args.workload == "prefill"
    return EngineConfig(
        model=args.model, dtype="float32", device="cpu", num_kv_blocks=2048,
        max_model_len=max(1024, args.prompt_len + 1), max_num_seqs=args.batch,
        max_num_batched_tokens=args.chunk if prefill else 4096, detokenize=False,
    )  # fmt: skip


class _HoldingConnector:
    """Leases without data: open from offer until declined (``pp2-handoffs``)."""

    def __init__(self, name: str, on_release):
        self.name, self.on_release, self.lease = name, on_release, 0

    def offer(self, request_id, block_ids, *, num_tokens, first_token_id, **layout):
        from kvtransfer import KVHandle

        self.lease += 1
        return KVHandle(self.name, request_id, self.lease, tuple(block_ids), "fp",
                        num_tokens, first_token_id, 60.0, time.time())  # fmt: skip

    def decline(self, handles, reason: str) -> None:
        self.on_release(handles[0].req_id, reason)


class _HandOffs:
    """Rank 0's side of ``pp2-handoffs``: an offer every 2nd step, declined 4 steps later."""

    def __init__(self, kv):
        self.kv, self.open, self.num = kv, [], 0

    def __call__(self, step: int) -> None:
        self.kv.poll()  # what the service's loop does every round
        if step % 2 == 0:
            self.num += 1
            self.open.append((step + 4, self.kv.offer(
                f"held{self.num}", [1, 2], num_tokens=16, first_token_id=1)))  # fmt: skip
        while self.open and self.open[0][0] <= step:
            handles = self.open[0][1]
            if hasattr(handles, "result"):  # a future: every rank's handle, once answered
                if not handles.done():
                    break
                handles = handles.result()
            self.open.pop(0)
            self.kv.decline(handles)


def _prefill(engine, args: argparse.Namespace) -> float:
    """Median time to first token (ms) of lone prompts, sent one at a time."""
    from workers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(args.prompts + 1):  # the first warms up
        # Every prompt differs from its first token on: no prefix-cache hits.
        prompt = [(7 * i + 3 * j) % 1000 + 1 for j in range(args.prompt_len)]
        t0 = time.perf_counter()
        engine.add_request(prompt, params, f"p{i}")
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1000


def _workload(engine, args: argparse.Namespace, each_step=None) -> float:
    if args.workload == "prefill":
        return _prefill(engine, args)
    return _decode(engine, args.batch, args.steps, each_step)


def _decode(engine, batch: int, steps: int, each_step=None) -> float:
    """Decode tokens/s once every request has its first token."""
    from workers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(256)], params, f"r{i}")
    started: set[str] = set()
    t0 = None
    step = 0
    while engine.has_unfinished_requests():
        if each_step is not None and t0 is not None:
            each_step(step)
            step += 1
        for delta in engine.step():
            started.add(delta.request_id)
        if t0 is None and len(started) == batch:
            t0 = time.perf_counter()
    assert t0 is not None
    return batch * steps / (time.perf_counter() - t0)


def _rank_main(rank: int, setup: str, port: int, args: argparse.Namespace, out: str) -> None:
    from workers.engine.llm_engine import LLMEngine
    from workers.parallel.replica_follower import RankFollower
    from workers.parallel.replica_kv import ReplicaKV

    torch.set_num_threads(1)
    parallel, link = join_replica(rank, 2, "127.0.0.1", port, "cpu", pp_size=2)
    config = _config(args)
    try:
        handoffs = setup == "pp2-handoffs"
        if rank != 0:
            follower = RankFollower(
                LLMEngine(config, parallel=parallel, agree_num_blocks=agree_min(link)), link
            )
            if handoffs:
                follower.connector = _HoldingConnector("rank1", follower.on_release)
            follower.run()
            return
        kv = ReplicaKV(link)
        if handoffs:
            kv.bind(_HoldingConnector("rank0", kv.local_released), lambda *a: None, lambda: None)
        engine = LLMEngine(
            config, parallel=parallel, before_forward=kv.before_forward,
            agree_num_blocks=agree_min(link),
            batches_in_flight=1 if setup == "pp2-in-turn" else 2,
        )  # fmt: skip
        kv.bind_engine(lambda: engine.num_in_flight, engine.drain)
        rate = _workload(engine, args, _HandOffs(kv) if handoffs else None)
        kv.close()
        Path(out, "rate.json").write_text(json.dumps(rate))
    finally:
        leave_replica()


def _single_main(_: int, args: argparse.Namespace, out: str) -> None:
    from workers.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    Path(out, "rate.json").write_text(json.dumps(_workload(LLMEngine(_config(args)), args)))


def _measure(setup: str, args: argparse.Namespace) -> float:
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
    parser.add_argument("--model", required=True, help="a `small` model directory")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--workload", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prefill workload")
    parser.add_argument("--chunk", type=int, default=128, help="prefill workload: budget")
    parser.add_argument("--prompts", type=int, default=3, help="prefill workload")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setups", help="comma-separated subset of the setups")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    setups = ("single", "pp2-in-turn", "pp2-in-flight", "pp2-handoffs")
    if args.setups:
        setups = tuple(args.setups.split(","))
    unit = "ms to first token" if args.workload == "prefill" else "tokens/s"
    runs: dict[str, list[float]] = {s: [] for s in setups}
    for repeat in range(args.repeats):
        for setup in setups:
            runs[setup].append(_measure(setup, args))
            print(f"repeat {repeat + 1}: {setup}: {runs[setup][-1]:.1f} {unit}", flush=True)
    median = {s: statistics.median(v) for s, v in runs.items()}
    result: dict = {"workload": args.workload, "runs": runs}
    if args.workload == "prefill":
        result |= {"prompt_len": args.prompt_len, "chunk": args.chunk, "prompts": args.prompts}
        result["median_ttft_ms"] = median
    else:
        result |= {"batch": args.batch, "steps": args.steps, "median_tokens_per_s": median}
    for a, b in (("pp2-in-flight", "pp2-in-turn"), ("pp2-in-flight", "single"),
                 ("pp2-handoffs", "pp2-in-flight"), ("pp2-handoffs", "pp2-in-turn")):  # fmt: skip
        if a in median and b in median:
            # A speed-up either way: a higher rate, or a shorter time to first token.
            speedup = median[b] / median[a] if args.workload == "prefill" else median[a] / median[b]
            result[f"{a}_vs_{b}"] = speedup
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
