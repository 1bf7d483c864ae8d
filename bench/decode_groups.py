"""Decode attention on CPU (the reference op): one padded batch against groups by length.

``kernels/paged_attention.py`` pads each group of decodes to its own longest context
(``AttentionMetadata.decode_groups``). This times one layer's decode attention for
batches of mixed context lengths, the ``small`` model's attention shape (12 query heads,
4 kv heads of 64, float32, blocks of 16), with the allocator setting the engine uses:

- ``one group``: the whole batch padded to its longest context (the op before groups);
- ``groups``: the op's constants (``_GROUP_COST_BYTES``, ``_GROUP_MAX_BYTES``);
- a sweep of the two constants, which is how they were chosen.

Medians of ``--repeats`` calls, ``--threads`` threads.

    python bench/decode_groups.py --json bench/decode_groups.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# Run as a script, this directory would shadow the top-level packages (kernels, ...).
sys.path[:] = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from workers.cpu_memory import keep_freed_memory_mapped  # noqa: E402

op = importlib.import_module("kernels.paged_attention")  # the module, not the function
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16
TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * 4
# (batch, shortest, longest context): uniform in between.
CASES = [(32, 16, 768), (32, 400, 500), (8, 16, 768), (128, 16, 1024), (64, 100, 2000)]
SWEEP = [(c, m) for c in (512, 1024, 2048, 4096) for m in (2048, 4096, 8192, 1 << 40)]


def _batch(num: int, shortest: int, longest: int, rng: random.Random):
    lens = [rng.randint(shortest, longest) for _ in range(num)]
    counts = [-(-n // BLOCK) for n in lens]
    cache = torch.randn(sum(counts) + 1, 2, KV_HEADS, BLOCK, HEAD_DIM)
    ids = (torch.randperm(sum(counts)) + 1).tolist()  # scattered, as in a busy cache
    tables = torch.zeros(num, max(counts), dtype=torch.int32)
    for row, count in enumerate(counts):
        tables[row, :count] = torch.tensor(ids[:count])
        del ids[:count]

    def metadata() -> AttentionMetadata:  # fresh each call: groups are memoized per step
        return AttentionMetadata(
            torch.zeros(num, dtype=torch.long), tables, torch.tensor(lens, dtype=torch.int32),
            torch.arange(num + 1, dtype=torch.int32), num, 1, max(lens), tuple(lens), (1,) * num,
        )  # fmt: skip

    return torch.randn(num, HEADS, HEAD_DIM), cache, metadata


def _time_ms(query, cache, metadata, cost_tokens: int, max_tokens: int, repeats: int) -> float:
    op._GROUP_COST_BYTES, op._GROUP_MAX_BYTES = cost_tokens * TOKEN_BYTES, max_tokens * TOKEN_BYTES
    times = []
    for _ in range(repeats):
        md = metadata()
        t0 = time.perf_counter()
        op.paged_attention(query, cache, md, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


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
        one = _time_ms(query, cache, metadata, 1 << 40, 1 << 40, args.repeats)
        grouped = _time_ms(query, cache, metadata, *default, args.repeats)
        sweep = {f"{c}/{m}": _time_ms(query, cache, metadata, c, m, args.repeats) for c, m in SWEEP}
        row = {"batch": num, "context": [shortest, longest], "one_group_ms": one,
               "groups_ms": grouped, "speedup": one / grouped,
               "groups": len(metadata().decode_groups(*default)), "sweep_ms": sweep}  # fmt: skip
        results.append(row)
        print(f"batch {num}, context {shortest}-{longest}: one group {one:.2f} ms, "
              f"{row['groups']} groups {grouped:.2f} ms ({one / grouped:.2f}x)", flush=True)  # fmt: skip
    out = {"threads": args.threads, "default_cost_and_max_tokens": default, "cases": results}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
