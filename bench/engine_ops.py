"""Where the engine's time goes on CPU: bench/engine.py's workload, each op class timed.

Runs Baton's side of ``bench/engine.py`` (same workload, same engine settings) with a
timer around every call of: the linear layers and LM head (``matmul``), decode and extend
attention (``kernels/paged_attention.py``), the KV store, the norms, rotary and SiLU-and-mul
(through the model's ``KernelOps``). "rest" is the wall time not inside any of them
(embedding, residual adds, reshapes, sampling, scheduling, Python). Medians over
``--repeats`` cold repeats (prefix cache emptied); the timers add a little to each call.

    python -m bench.engine_ops --model /tmp/small --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import json
import statistics
import time
from pathlib import Path

import kernels
from bench import engine as engine_bench
from workers import LLM, SamplingParams
from workers.models import loader

attention = importlib.import_module("kernels.paged_attention")  # the module, not the function
spent: collections.Counter[str] = collections.Counter()


def timed(fn, name: str):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (e.g. a small llama)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    ref = kernels.REFERENCE_OPS
    ops = {f.name: timed(getattr(ref, f.name), f.name) for f in dataclasses.fields(ref)}
    del ops["paged_attention"]  # timed inside, decode and extend apart
    loader.get_kernel_ops = lambda device: dataclasses.replace(ref, **ops)
    attention._decode_attention = timed(attention._decode_attention, "decode_attention")
    attention._extend_attention = timed(attention._extend_attention, "extend_attention")
    llm = LLM(args.model, dtype="float32", max_num_seqs=32, max_num_batched_tokens=2048)
    for module in llm.engine.model.modules():
        if hasattr(module, "matmul"):
            module.matmul = timed(module.matmul, "linear")
    work = engine_bench.make_workload(args.num_requests, llm.engine.vocab_size, 0)
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4))  # warm-up

    runs = []
    for _ in range(args.repeats):
        spent.clear()
        seconds, _ = engine_bench.run_baton(llm, work)
        run = dict(spent)
        run["rest"] = seconds - sum(spent.values())
        run["total"] = seconds
        runs.append(run)
        print(" ".join(f"{k} {v:.2f}s" for k, v in run.items()), flush=True)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    total = median["total"]
    for name, secs in sorted(median.items(), key=lambda kv: -kv[1]):
        if name != "total":
            print(f"{name:18s} {secs:6.2f} s  {100 * secs / total:5.1f} %")
    print(f"{'total':18s} {total:6.2f} s")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "median": median}, indent=2) + "\n")


if __name__ == "__main__":
    main()
