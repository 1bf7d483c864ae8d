"""CPU linear layers: ``F.linear`` (MKL's sgemm) against oneDNN over a packed weight.

The engine packs every linear weight for oneDNN at load on CPU (``kernels/cpu_linear.py``).
This times one decoder layer's linears plus the LM head of the ``small`` Llama
(qkv 1280x768, o 768x768, gate_up 4096x768, down 768x2048, lm_head 8192x768; float32)
at each number of rows (tokens in the step), both ways, the two taking turns round by
round (a round: each weight ``max(1, 64 // rows)`` times), so that drift of the machine
hits both alike. Medians of ``--repeats`` rounds;
GFLOP/s counts ``2 * rows * weight elements``.

    python -m bench.linear --json bench/linear.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.tools.make_model import make_config
from kernels import cpu_linear
from workers.engine.cpu_memory import keep_freed_memory_mapped

ROWS = [1, 2, 3, 4, 8, 16, 32, 64, 256, 2048]


def weight_shapes() -> dict[str, tuple[int, int]]:
    """[out, in] of the small Llama's linears, from the config ``baton make-model`` writes."""
    c = make_config("llama", "small")
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * c["intermediate_size"], hidden),
        "down_proj": (hidden, c["intermediate_size"]),
        "lm_head": (c["vocab_size"], hidden),
    }


def time_round(fn, inputs, weights, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        for x, w in zip(inputs, weights, strict=True):
            fn(x, w)
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if not cpu_linear.packing_supported(torch.float32):
        sys.exit("this torch build has no oneDNN linear: nothing to compare")
    torch.set_num_threads(args.threads)
    keep_freed_memory_mapped()  # the engine's allocator setting on CPU

    gen = torch.Generator().manual_seed(0)
    shapes = weight_shapes()
    plain = [torch.randn(shape, generator=gen) * 0.02 for shape in shapes.values()]
    packed = [cpu_linear.pack(w) for w in plain]
    flops_per_row = 2 * sum(w.numel() for w in plain)
    rows_out = []
    with torch.inference_mode():
        for num_rows in ROWS:
            inputs = [torch.randn(num_rows, w.shape[1], generator=gen) for w in plain]
            for x, w, p in zip(inputs, plain, packed, strict=True):  # same answer first
                torch.testing.assert_close(
                    cpu_linear.linear(x, p), F.linear(x, w), rtol=1e-4, atol=1e-4
                )
            calls = max(1, 64 // num_rows)
            times: dict[str, list[float]] = {"f_linear": [], "onednn": []}
            time_round(F.linear, inputs, plain, 1)  # warm both
            time_round(cpu_linear.linear, inputs, packed, 1)
            for _ in range(args.repeats):
                times["f_linear"].append(time_round(F.linear, inputs, plain, calls))
                times["onednn"].append(time_round(cpu_linear.linear, inputs, packed, calls))
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {
                "rows": num_rows,
                "f_linear_ms": med["f_linear"] * 1e3,
                "onednn_ms": med["onednn"] * 1e3,
                "f_linear_gflops": flops_per_row * num_rows / med["f_linear"] / 1e9,
                "onednn_gflops": flops_per_row * num_rows / med["onednn"] / 1e9,
                "speedup": med["f_linear"] / med["onednn"],
            }
            rows_out.append(row)
            print(
                f"rows {num_rows:5d}: F.linear {row['f_linear_ms']:7.2f} ms "
                f"({row['f_linear_gflops']:4.0f} GFLOP/s) | oneDNN {row['onednn_ms']:7.2f} ms "
                f"({row['onednn_gflops']:4.0f} GFLOP/s) | {row['speedup']:.2f}x",
                flush=True,
            )
    if args.json:
        result = {
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "threads": args.threads,
            "torch": torch.__version__,
            "shapes": shapes,
            "repeats": args.repeats,
            "rows": rows_out,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
