"""Cost of rank 0 driving a parallel replica: the step command, on CPU (gloo).

``--tp`` x ``--pp`` ranks (default 2 x 1) in as many processes on this machine, joined
like a cluster replica (``workers/parallel/replica.py``). Two measurements:

1. **The command alone**: rank 0 encodes a step's :class:`StepInputs` into a
   :class:`RankCommand`, sends it and waits until every rank has it (``send`` +
   ``settle``; figures before batches in flight were a gloo broadcast); the other rank
   decodes it. Decode steps of
   batch 1 / 8 / 32 / 64 at 1k and 4k tokens of context (the block table grows with the
   context), and one 2048-token prefill chunk. Per shape: the payload, and the median
   over ``--rounds`` of rank 0's time (encode + broadcast) and the other rank's
   (receive + decode; the slowest of the other ranks).
2. **Its share of a real step**: a Llama-shaped ``small`` model (``baton make-model
   --size small``) at the given TP x PP, float32, ``--batch`` requests decoding together;
   rank 0 (the last stage) times every decode step and the part of it spent in
   ``before_forward`` (encode + broadcast). Reported: medians of both and the share.

    python -m bench.replica --model /tmp/small --json bench/replica.json
    python -m bench.replica --model /tmp/small --tp 1 --pp 2 --json bench/replica_pp.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from workers.engine.step_inputs import StepInputs
from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica
from workers.parallel.replica_messages import RankCommand, decode_command, encode_command

BLOCK_SIZE = 16
SHAPES = [(b, ctx, 1) for ctx in (1024, 4096) for b in (1, 8, 32, 64)] + [(1, 2048, 2048)]


def _inputs(batch: int, context: int, query: int) -> StepInputs:
    """``batch`` sequences of ``context`` tokens, ``query`` of them new (1: a decode)."""
    blocks = -(-context // BLOCK_SIZE)
    rng = np.random.default_rng(0)
    tables = rng.integers(0, 100_000, size=(batch, blocks), dtype=np.int32)
    num_tokens = batch * query
    positions = np.tile(np.arange(context - query, context, dtype=np.int64), batch)
    return StepInputs(
        input_ids=rng.integers(0, 32_000, size=num_tokens, dtype=np.int64),
        positions=positions,
        slot_mapping=rng.integers(0, 1_600_000, size=num_tokens, dtype=np.int64),
        block_tables=tables,
        seq_lens=(context,) * batch,
        query_start_loc=tuple(range(0, num_tokens + 1, query)),
        num_decodes=batch if query == 1 else 0,
        sample_indices=tuple(range(query - 1, num_tokens, query)),
    )


def _broadcast_main(rank: int, tp: int, pp: int, port: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    _, link = join_replica(rank, tp * pp, "127.0.0.1", port, "cpu", pp)
    results = []
    try:
        for batch, context, query in SHAPES:
            inputs = _inputs(batch, context, query)
            times = []
            size = 0
            for seq in range(rounds + 5):  # 5 warm-up rounds
                t0 = time.perf_counter()
                if rank == 0:
                    data = encode_command(RankCommand(seq=seq, step=inputs))
                    link.send(data)
                    link.settle()  # every rank has it
                    size = len(data)
                else:
                    decode_command(link.receive())
                if seq >= 5:
                    times.append(time.perf_counter() - t0)
            results.append(
                {
                    "batch": batch,
                    "context": context,
                    "query": query,
                    "bytes": size,
                    "median_us": statistics.median(times) * 1e6,
                }
            )
        Path(out, f"broadcast{rank}.json").write_text(json.dumps(results))
    finally:
        leave_replica()


def _engine_main(
    rank: int, tp: int, pp: int, port: int, model: str, batch: int, steps: int, out: str
) -> None:
    from workers import SamplingParams
    from workers.engine.config import EngineConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.parallel.replica_follower import RankFollower
    from workers.parallel.replica_kv import ReplicaKV

    torch.set_num_threads(1)  # one core per rank
    parallel, link = join_replica(rank, tp * pp, "127.0.0.1", port, "cpu", pp)
    config = EngineConfig(
        model=model,
        dtype="float32",
        device="cpu",
        max_model_len=1024,
        num_kv_blocks=2048,
        max_num_seqs=batch,
        max_num_batched_tokens=4096,
        detokenize=False,
    )
    try:
        if rank != 0:
            follower = RankFollower(
                LLMEngine(config, parallel=parallel, agree_num_blocks=agree_min(link)), link
            )
            follower.run()
            return
        kv = ReplicaKV(link)
        spent: list[float] = []

        def timed(inputs: StepInputs) -> None:
            t0 = time.perf_counter()
            kv.before_forward(inputs)
            spent.append(time.perf_counter() - t0)

        engine = LLMEngine(
            config, parallel=parallel, before_forward=timed, agree_num_blocks=agree_min(link)
        )
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(7 * i + j) % 1000 + 1 for j in range(256)], params, f"r{i}")
        step_s, share_s = [], []
        while engine.has_unfinished_requests():
            spent.clear()
            t0 = time.perf_counter()
            deltas = engine.step()
            elapsed = time.perf_counter() - t0
            if len(deltas) == batch and len(engine.scheduler.running) == batch and spent:
                step_s.append(elapsed)  # a decode step of the whole batch
                share_s.append(spent[0])
        kv.close()
        Path(out, "engine.json").write_text(
            json.dumps(
                {
                    "tp": tp,
                    "pp": pp,
                    "batch": batch,
                    "decode_steps": len(step_s),
                    "step_ms": statistics.median(step_s) * 1e3,
                    "broadcast_ms": statistics.median(share_s) * 1e3,
                    "share": statistics.median(
                        [b / s for b, s in zip(share_s, step_s, strict=True)]
                    ),
                }
            )
        )
    finally:
        leave_replica()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a `small` model directory; omit to skip part 2")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per stage")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    world = args.tp * args.pp
    if world < 2:
        parser.error("--tp x --pp must be at least 2 (a broadcast needs a receiver)")
    report: dict = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "tp": args.tp,
        "pp": args.pp,
    }
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _broadcast_main,
            args=(args.tp, args.pp, free_port("127.0.0.1"), args.rounds, out),
            nprocs=world,
            start_method="spawn",
        )
        sender = json.loads(Path(out, "broadcast0.json").read_text())
        receivers = [
            json.loads(Path(out, f"broadcast{r}.json").read_text()) for r in range(1, world)
        ]
        report["broadcast"] = [
            {**s, "receiver_us": max(r["median_us"] for r in rows), "sender_us": s.pop("median_us")}
            for s, *rows in zip(sender, *receivers, strict=True)
        ]
        print("batch  context  query  payload(B)  rank0 us  others us (slowest)")
        for row in report["broadcast"]:
            print(
                f"{row['batch']:5d}  {row['context']:7d}  {row['query']:5d}  {row['bytes']:10d}"
                f"  {row['sender_us']:8.1f}  {row['receiver_us']:8.1f}"
            )
        if args.model:
            mp.start_processes(
                _engine_main,
                args=(
                    args.tp, args.pp, free_port("127.0.0.1"), args.model, args.batch,
                    args.steps, out,
                ),
                nprocs=world,
                start_method="spawn",
            )  # fmt: skip
            report["engine"] = json.loads(Path(out, "engine.json").read_text())
            e = report["engine"]
            print(
                f"TP={args.tp} x PP={args.pp} decode step, batch {e['batch']}: "
                f"{e['step_ms']:.2f} ms, of which "
                f"broadcast {e['broadcast_ms']:.3f} ms ({100 * e['share']:.2f}%), "
                f"{e['decode_steps']} steps"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
