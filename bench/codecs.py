"""Encode + decode round trips per second of the three wire codecs' busiest messages.

- ``output_batch``: an :class:`OutputBatch` of 32 :class:`TokenEvent` (one token each)
  with its :class:`WorkerReport`, as a decode worker sends the router every engine step
  (``workers/protocol/wire.py``);
- ``work_item``: a :class:`WorkItem` with a 512-token prompt (router -> worker, per request);
- ``kv_handle``: a :class:`KVHandle` of 64 blocks (prefill -> router -> decode, per request
  and rank; ``kvtransfer/messages.py``);
- ``rank_command``: a :class:`RankCommand` carrying a 32-sequence decode step at 1k tokens of
  context (rank 0 -> the other ranks of a tensor-parallel replica, every step;
  ``workers/parallel/replica_messages.py``).

Only the public constructors and ``encode``/``decode`` functions are used, so the script
runs unchanged on the codecs before and after issue 44 (msgspec). Each figure is the
median of ``--repeats`` timed runs of about ``--seconds`` each, in one process::

    python -m bench.codecs --json bench/codecs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvtransfer import messages as kv
from workers.engine.step_inputs import StepInputs
from workers.parallel import replica_messages as rm
from workers.protocol import wire
from workers.protocol.sampling_params import SamplingParams


def _output_batch() -> wire.OutputBatch:
    events = tuple(
        wire.TokenEvent(f"req-{i:04d}", (1000 + i,), False, num_prompt_tokens=300 + i)
        for i in range(32)
    )
    report = wire.WorkerReport(
        name="decode-0",
        role="decode",
        healthy=True,
        num_running=32,
        num_waiting=3,
        kv_blocks_total=4096,
        kv_blocks_used=1800,
        kv_blocks_cached=250,
        num_held=0,
    )
    return wire.OutputBatch(events, report)


def _work_item() -> wire.WorkItem:
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, seed=1234)
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(0, 32_000, 512))
    return wire.WorkItem("req-0001", prompt, params, "full")


def _kv_handle() -> kv.KVHandle:
    return kv.KVHandle(
        agent_name="prefill-0#3f2a",
        req_id="req-0001",
        lease_id=12345,
        block_ids=tuple(range(1000, 1064)),
        fingerprint="0123456789abcdef",
        num_tokens=1020,
        first_token_id=42,
        lease_seconds=30.0,
        issued_unix=1_790_000_000.25,
    )


def _rank_command(batch: int = 32, context: int = 1024, block_size: int = 16) -> rm.RankCommand:
    rng = np.random.default_rng(0)
    blocks = -(-context // block_size)
    step = StepInputs(
        input_ids=rng.integers(0, 32_000, size=batch, dtype=np.int64),
        positions=np.full(batch, context - 1, dtype=np.int64),
        slot_mapping=rng.integers(0, 1_600_000, size=batch, dtype=np.int64),
        block_tables=rng.integers(0, 100_000, size=(batch, blocks), dtype=np.int32),
        seq_lens=(context,) * batch,
        query_start_loc=tuple(range(batch + 1)),
        num_decodes=batch,
        sample_indices=tuple(range(batch)),
    )
    return rm.RankCommand(seq=7, step=step)


def cases() -> dict[str, tuple[Callable[[], bytes], Callable[[bytes], object]]]:
    batch, item, handle, command = _output_batch(), _work_item(), _kv_handle(), _rank_command()
    return {
        "output_batch": (
            lambda: wire.encode(batch),
            lambda data: wire.decode_as(data, wire.OutputBatch),
        ),
        "work_item": (lambda: wire.encode(item), lambda data: wire.decode_as(data, wire.WorkItem)),
        "kv_handle": (lambda: kv.encode(handle), lambda data: kv.decode_as(data, kv.KVHandle)),
        "rank_command": (lambda: rm.encode_command(command), rm.decode_command),
    }


def _rate(encode: Callable[[], bytes], decode: Callable[[bytes], object], seconds: float) -> float:
    """Round trips per second over about ``seconds``."""
    n = 1
    while True:  # calibrate: about a tenth of the run
        t0 = time.perf_counter()
        for _ in range(n):
            decode(encode())
        elapsed = time.perf_counter() - t0
        if elapsed > seconds / 10:
            break
        n *= 2
    n = max(1, int(n * seconds / elapsed))
    t0 = time.perf_counter()
    for _ in range(n):
        decode(encode())
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="per timed run")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = {}
    for name, (encode, decode) in cases().items():
        data = encode()
        decode(data)  # warm up; fails loudly if the round trip does
        rates = [_rate(encode, decode, args.seconds) for _ in range(args.repeats)]
        median = statistics.median(rates)
        results[name] = {"bytes": len(data), "round_trips_per_s": round(median), "runs": rates}
        print(
            f"{name:14s} {len(data):6d} B  {median:12,.0f} round trips/s  ({1e6 / median:.2f} µs)"
        )
    if args.json:
        document = {
            "machine": platform.platform(),
            "python": platform.python_version(),
            "versions": {"wire": wire.WIRE_VERSION, "replica": rm.REPLICA_WIRE_VERSION},
            "kvtransfer_version": kv.PROTOCOL_VERSION,
            "repeats": args.repeats,
            "results": results,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
