"""MoE decode speed with FP8 / INT4 experts (quantized on load) against float32, on CPU.

Model: ``baton make-model --arch qwen3-moe --size small`` (10 layers, hidden 768, 8
experts of intermediate 256, top-2), made once under .models/, loaded in float32 as
three ``LLM``s in this process: ``fp32`` (unquantized), ``fp8`` and ``int4``
(``quantization`` on load: the attention as the dense path does it, the experts by
workers/models/quant/experts.py). Decode tokens/s as bench/quant_speed.py measures it
(``generate`` of 1 + N tokens minus that of 1, for B * N decode tokens; also per
CPU-second of this process), the variants alternating within each repeat; medians.

``--experts`` first times one active expert's MLP (w13 then w2) each way the grouped
computation could run it, at 1, 8 and 64 tokens: float32, torch's CPU int4 kernel per
expert, dequantizing the int4 expert then ``F.linear``, dequantizing the fp8 expert then
``F.linear``: the measurement behind the int4 kernel choice.

    python -m bench.moe_quant --threads 1 --repeats 3 --experts --json bench/moe_quant.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from bench.quant_speed import decode_rate, timed_generate
from cluster.tools.make_model import make_model
from kernels.activation import silu_and_mul
from kernels.timing import fastest
from workers import LLM
from workers.models.quant.experts import _quantize

VARIANTS = {"fp32": "none", "fp8": "fp8", "int4": "int4"}


def expert_timings(hidden: int = 768, inter: int = 256) -> dict[str, dict[int, float]]:
    """Microseconds of one expert's MLP by each path, at 1 / 8 / 64 tokens (best of 5)."""
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(1, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(1, hidden, inter, generator=gen) / inter**0.5
    cpu = torch.device("cpu")
    paths = {
        "fp32": lambda x: silu_and_mul(x @ w13[0].t()) @ w2[0].t(),
        "int4 kernel": _quantize(w13, w2, 1, "int4", cpu, use_triton=False).mlp,
        # use_triton: the stack the Triton op set gets (dequantized per expert), here on CPU
        "int4 dequantize": _quantize(w13, w2, 1, "int4", cpu, use_triton=True).mlp,
        "fp8 dequantize": _quantize(w13, w2, 1, "fp8", cpu, use_triton=False).mlp,
    }
    out: dict[str, dict[int, float]] = {name: {} for name in paths}
    for rows in (1, 8, 64):
        x = torch.randn(rows, hidden, generator=gen)
        calls = [
            (lambda f=f, x=x: f(x)) if name == "fp32" else (lambda f=f, x=x: f(0, x))
            for name, f in paths.items()
        ]
        with torch.inference_mode():
            times = fastest(calls, 5, inner=3)
        for name, seconds in zip(paths, times, strict=True):
            out[name][rows] = round(seconds * 1e6, 1)
    return out


def expert_bytes(llm: LLM) -> int:
    """Bytes of layer 0's expert weights (values and scales)."""
    stacks = llm.engine.model.model.layers[0].mlp.experts.stacked()
    return sum(t.numel() * t.element_size() for t in stacks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(".models/bench-moe-small"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-decode", type=int, default=16, help="decode tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--experts", action="store_true", help="also time one expert's paths")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_before": os.getloadavg(),
    }
    if args.experts:
        result["expert_us"] = expert_timings()
        for name, row in result["expert_us"].items():
            print(f"{name:16} " + "  ".join(f"{r:2d} rows {us:7.1f} us" for r, us in row.items()))
    if not (args.model / "config.json").exists():
        make_model(args.model, "qwen3-moe", "small")
    llms = {}
    for name, quantization in VARIANTS.items():
        llms[name] = LLM(str(args.model), dtype="float32", quantization=quantization,
                         max_num_seqs=max(args.batches), kv_cache_memory_gib=0.25)  # fmt: skip
        timed_generate(llms[name], 2, 4)  # warm-up
    rates = {name: {b: [] for b in args.batches} for name in llms}
    for repeat in range(args.repeats):
        for batch in args.batches:
            for name, llm in llms.items():  # alternating: each variant sees the same load
                tps, cpu_tps = decode_rate(llm, batch, args.num_decode)
                rates[name][batch].append((tps, cpu_tps))
                print(f"repeat {repeat} batch {batch:2d} {name}: {tps:7.1f} tok/s, "
                      f"{cpu_tps:7.1f} tok/CPU-s", flush=True)  # fmt: skip
    summary: dict[str, dict] = {}
    for batch in args.batches:
        base = rates["fp32"][batch]
        for name in llms:
            runs = rates[name][batch]
            summary.setdefault(str(batch), {})[name] = {
                "median_tok_per_s": statistics.median(r[0] for r in runs),
                "median_tok_per_cpu_s": statistics.median(r[1] for r in runs),
                "median_ratio_vs_fp32": statistics.median(
                    r[0] / b[0] for r, b in zip(runs, base, strict=True)
                ),
                "median_cpu_ratio_vs_fp32": statistics.median(
                    r[1] / b[1] for r, b in zip(runs, base, strict=True)
                ),
            }
    print("\nbatch  variant  tok/s (median)  x fp32   tok/CPU-s  x fp32")
    for batch, row in summary.items():
        for name, s in row.items():
            print(f"{batch:>5}  {name:7}  {s['median_tok_per_s']:14.1f}  "
                  f"{s['median_ratio_vs_fp32']:5.2f}x  {s['median_tok_per_cpu_s']:9.1f}  "
                  f"{s['median_cpu_ratio_vs_fp32']:5.2f}x")  # fmt: skip
    result |= {
        "summary": summary,
        "num_decode": args.num_decode,
        "repeats": args.repeats,
        "load_after": os.getloadavg(),
        "expert_bytes_layer0": {name: expert_bytes(llm) for name, llm in llms.items()},
        "int4_kernel": llms["int4"].engine.model.model.layers[0].mlp.experts.quantized.kernel,
    }
    print("expert bytes, layer 0:", result["expert_bytes_layer0"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
