"""Pipeline-parallel decode throughput: batches in flight against stages in turn (CPU).

A ``small`` Llama-shaped model (``baton make-model --size small``), float32, ``--batch``
requests decoding ``--steps`` tokens each after a 256-token prompt. Three setups, each
in fresh processes, one thread per process, ``--repeats`` times in turn:

- ``single``: one process, the whole model (the reference);
- ``pp2-in-turn``: a TP=1 x PP=2 replica (two processes) with one batch at a time, so
  each stage waits while the other computes (``batches_in_flight=1``);
- ``pp2-in-flight``: the same replica with one batch per stage in flight (the default);
- ``pp2-handoffs``: ``pp2-in-flight`` while KV hand-offs are open on both ranks, as in
  a disaggregated prefill pool: every 2nd step rank 0 offers a request's blocks on both
  ranks, and declines them (the decode side's notice) 4 steps later, so a lease is
  always open on rank 1 and rank 0 takes in its news. The connectors only keep the
  leases' books (no data moves; what is measured is what the news costs the engine).

Reported per setup: decode tokens/s, from the moment every request has its first token
to the last one's end (medians over the repeats), and ratios against ``single`` and
``pp2-in-turn``. Rank 0 (the last stage) measures.

    python bench/pipeline.py --model /tmp/small --json bench/pipeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

# Run as a script, this directory would shadow the top-level packages (kernels, ...).
sys.path[:] = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from workers.replica import agree_min, free_port, join_replica, leave_replica  # noqa: E402


def _config(model: str, batch: int):
    from workers.config import EngineConfig

    return EngineConfig(
        model=model, dtype="float32", device="cpu", max_model_len=1024, num_kv_blocks=2048,
        max_num_seqs=batch, max_num_batched_tokens=4096, detokenize=False,
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


def _rank_main(
    rank: int, setup: str, port: int, model: str, batch: int, steps: int, out: str
) -> None:
    from workers.engine import LLMEngine
    from workers.replica_follower import RankFollower
    from workers.replica_kv import ReplicaKV

    torch.set_num_threads(1)
    parallel, link = join_replica(rank, 2, "127.0.0.1", port, "cpu", pp_size=2)
    config = _config(model, batch)
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
        rate = _decode(engine, batch, steps, _HandOffs(kv) if handoffs else None)
        kv.close()
        Path(out, "rate.json").write_text(json.dumps(rate))
    finally:
        leave_replica()


def _single_main(_: int, model: str, batch: int, steps: int, out: str) -> None:
    from workers.engine import LLMEngine

    torch.set_num_threads(1)
    Path(out, "rate.json").write_text(
        json.dumps(_decode(LLMEngine(_config(model, batch)), batch, steps))
    )


def _measure(setup: str, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as out:
        if setup == "single":
            mp.start_processes(_single_main, args=(args.model, args.batch, args.steps, out),
                               nprocs=1, join=True, start_method="spawn")  # fmt: skip
        else:
            mp.start_processes(
                _rank_main,
                args=(setup, free_port("127.0.0.1"), args.model, args.batch, args.steps, out),
                nprocs=2, join=True, start_method="spawn",
            )  # fmt: skip
        return json.loads(Path(out, "rate.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a `small` model directory")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setups", help="comma-separated subset of the setups")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    setups = ("single", "pp2-in-turn", "pp2-in-flight", "pp2-handoffs")
    if args.setups:
        setups = tuple(args.setups.split(","))
    runs: dict[str, list[float]] = {s: [] for s in setups}
    for repeat in range(args.repeats):
        for setup in setups:
            runs[setup].append(_measure(setup, args))
            print(f"repeat {repeat + 1}: {setup}: {runs[setup][-1]:.1f} tokens/s", flush=True)
    median = {s: statistics.median(v) for s, v in runs.items()}
    result = {
        "batch": args.batch,
        "steps": args.steps,
        "runs": runs,
        "median_tokens_per_s": median,
    }
    for a, b in (("pp2-in-flight", "pp2-in-turn"), ("pp2-in-flight", "single"),
                 ("pp2-handoffs", "pp2-in-flight"), ("pp2-handoffs", "pp2-in-turn")):  # fmt: skip
        if a in median and b in median:
            result[f"{a}_vs_{b}"] = median[a] / median[b]
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
