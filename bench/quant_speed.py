"""Decode speed with INT4 weights against the unquantized path, on CPU, in the same run.

Model: a random Llama large enough for decode to be bound by reading the weights (default
hidden 2048, intermediate 5632, 6 layers, 16 heads / 4 KV heads, vocab 8192: 300M
linear weights, 1.2 GB in float32), made once under .models/. Variants, each its own
``LLM`` in this process, measured in alternation (the machine is shared and noisy):

- ``fp32``: the engine's CPU default (float32, oneDNN packed weights);
- ``bf16``: bfloat16 weights and activations (oneDNN packed);
- ``int4``: float32 model, ``quantization: int4`` on load (asymmetric, groups of 128,
  torch's int4-packed matmul with bfloat16 activations; embedding and LM head float32).

Decode tokens/s at batch B: B requests of 8 prompt tokens; the time of ``generate`` with
``max_tokens = 1 + N`` minus the time with ``max_tokens = 1`` (the prefill and first
token), for B * N decode tokens. Also tokens per CPU-second of this process (the same
difference in ``process_time``), which other processes' load disturbs less.

    python -m bench.quant_speed --repeats 5 --json bench/quant_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from cluster.tools.make_model import _random_weights, make_model
from workers import LLM, SamplingParams

_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "dtype": "float32",
}
VARIANTS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int4": {"dtype": "float32", "quantization": "int4"},
}


def bench_model(path: Path) -> Path:
    """The benchmark's model: `small` llama's tokenizer and config with a larger shape."""
    if (path / "config.json").exists():
        return path
    make_model(path, "llama", "small")
    config = json.loads((path / "config.json").read_text()) | _SHAPE
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(_random_weights(config, 0, True), str(path / "model.safetensors"))
    return path


def timed_generate(llm: LLM, batch: int, max_tokens: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of generating ``max_tokens`` for ``batch`` requests."""
    prompts = [[11 + i, 12, 13, 14, 15, 16, 17, 18] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.block_manager.evict()
    start, start_cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    assert sum(len(o.token_ids) for o in outs) == batch * max_tokens
    return elapsed, cpu


def decode_rate(llm: LLM, batch: int, num_decode: int) -> tuple[float, float]:
    """(decode tokens/s, decode tokens per CPU-second) at ``batch``."""
    first, first_cpu = timed_generate(llm, batch, 1)
    total, total_cpu = timed_generate(llm, batch, 1 + num_decode)
    tokens = batch * num_decode
    return tokens / (total - first), tokens / (total_cpu - first_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(".models/bench-quant-llama"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--num-decode", type=int, default=32, help="decode tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's); 1 keeps CPU time honest "
        "on a loaded machine, where waiting threads spin",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = bench_model(args.model)
    llms = {}
    for name, options in VARIANTS.items():
        llms[name] = LLM(str(model_dir), max_num_seqs=max(args.batches),
                         kv_cache_memory_gib=0.25, **options)  # fmt: skip
        timed_generate(llms[name], 2, 4)  # warm-up
    rates: dict[str, dict[int, list[tuple[float, float]]]] = {
        name: {b: [] for b in args.batches} for name in llms
    }
    for repeat in range(args.repeats):
        for batch in args.batches:
            for name, llm in llms.items():  # alternating: each variant sees the same load
                tps, cpu_tps = decode_rate(llm, batch, args.num_decode)
                rates[name][batch].append((tps, cpu_tps))
                print(f"repeat {repeat} batch {batch:2d} {name}: {tps:7.1f} tok/s, "
                      f"{cpu_tps:7.1f} tok/CPU-s", flush=True)  # fmt: skip

    summary: dict[str, dict] = {}
    for batch in args.batches:
        for name in llms:
            tps = [r[0] for r in rates[name][batch]]
            cpu = [r[1] for r in rates[name][batch]]
            base = [r[0] for r in rates["fp32"][batch]]
            base_cpu = [r[1] for r in rates["fp32"][batch]]
            summary.setdefault(str(batch), {})[name] = {
                "tok_per_s": tps,
                "tok_per_cpu_s": cpu,
                "median_tok_per_s": statistics.median(tps),
                "median_tok_per_cpu_s": statistics.median(cpu),
                # per repeat, against fp32 in the same repeat
                "median_ratio_vs_fp32": statistics.median(
                    t / b for t, b in zip(tps, base, strict=True)
                ),
                "median_cpu_ratio_vs_fp32": statistics.median(
                    t / b for t, b in zip(cpu, base_cpu, strict=True)
                ),
            }
    print("\nbatch  variant  tok/s (median)  x fp32   tok/CPU-s  x fp32")
    for batch, row in summary.items():
        for name, s in row.items():
            print(f"{batch:>5}  {name:7}  {s['median_tok_per_s']:14.1f}  "
                  f"{s['median_ratio_vs_fp32']:5.2f}x  {s['median_tok_per_cpu_s']:9.1f}  "
                  f"{s['median_cpu_ratio_vs_fp32']:5.2f}x")  # fmt: skip
    if args.json:
        result = {
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "model": _SHAPE,
            "num_decode": args.num_decode,
            "repeats": args.repeats,
            "summary": summary,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
