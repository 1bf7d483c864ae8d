"""Decode attention on CPU (the reference op): one padded batch against groups by length.

``kernels/paged_attention.py`` pads each group of decodes to its own longest context
(``AttentionMetadata.decode_groups``). This times one layer's decode attention for
batches of mixed context lengths, the ``small`` model's attention shape (12 query heads,
4 kv heads of 64, float32, blocks of 16), with the allocator setting the engine uses:

- ``one group``: the whole batch padded to its longest context (the op before groups);
- ``groups``: the op's constants (``_GROUP_COST_BYTES``, ``_GROUP_MAX_BYTES``);
- a sweep of the two constants, which is how they were chosen.

Medians of ``--repeats`` calls, ``--threads`` threads.

    python -m bench.decode_groups --json bench/decode_groups.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench.gpu_kernels import paged_batch
from workers.engine.cpu_memory import keep_freed_memory_mapped

op = importlib.import_module("kernels.paged_attention")  # the module, not the function
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16
TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * 4
# (batch, shortest, longest context): uniform in between.
CASES = [(32, 16, 768), (32, 400, 500), (8, 16, 768), (128, 16, 1024), (64, 100, 2000)]
SWEEP = [(c, m) for c in (512, 1024, 2048, 4096) for m in (2048, 4096, 8192, 1 << 40)]


def _batch(num: int, shortest: int, longest: int, rng: random.Random):
    """(query, layer view, metadata) of ``num`` decodes with scattered blocks."""
    lens = [rng.randint(shortest, longest) for _ in range(num)]
    return paged_batch([1] * num, lens, BLOCK, torch.float32, "cpu", num, HEADS, KV_HEADS, HEAD_DIM)


def _time_ms(query, cache, metadata, settings: list[tuple[int, int]], repeats: int) -> list[float]:
    """Median ms of each (cost, max) setting in row-tokens; the settings take turns call by
    call, so that the machine's drift during the run weighs on all of them alike."""
    times: list[list[float]] = [[] for _ in settings]
    for _ in range(repeats):
        for setting, samples in zip(settings, times, strict=True):
            op._GROUP_COST_BYTES, op._GROUP_MAX_BYTES = (t * TOKEN_BYTES for t in setting)
            md = dataclasses.replace(metadata)  # a new step: its groups are not memoized yet
            t0 = time.perf_counter()
            op.paged_attention(query, cache, md, HEAD_DIM**-0.5)
            samples.append(time.perf_counter() - t0)
    return [statistics.median(samples) * 1e3 for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory_mapped()
    default = (op._GROUP_COST_BYTES // TOKEN_BYTES, op._GROUP_MAX_BYTES // TOKEN_BYTES)
    rng = random.Random(0)
    results = []
    for num, shortest, longest in CASES:
        query, cache, metadata = _batch(num, shortest, longest, rng)
        one, grouped, *swept = _time_ms(
            query, cache, metadata, [(1 << 40, 1 << 40), default, *SWEEP], args.repeats
        )
        sweep = {f"{c}/{m}": ms for (c, m), ms in zip(SWEEP, swept, strict=True)}
        row = {"batch": num, "context": [shortest, longest], "one_group_ms": one,
               "groups_ms": grouped, "speedup": one / grouped,
               "groups": len(metadata.decode_groups(*default)), "sweep_ms": sweep}  # fmt: skip
        results.append(row)
        print(f"batch {num}, context {shortest}-{longest}: one group {one:.2f} ms, "
              f"{row['groups']} groups {grouped:.2f} ms ({one / grouped:.2f}x)", flush=True)  # fmt: skip
    out = {"threads": args.threads, "default_cost_and_max_tokens": default, "cases": results}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
