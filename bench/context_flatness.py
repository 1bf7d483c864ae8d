"""How a single-stream decode step's time grows with the context, on a real model.

One process, one loaded model (the engine's loader: oneDNN packing by timing, the C++
layer stack), one paged KV cache filled with random rows; then rounds that time a decode
step (embedding, the layers, the LM head) at each context length in turn, alternating, so
that load from elsewhere falls on every length alike. Reported: the median step per
length and its ratio to the shortest. Run once per KV-cache dtype (``auto``: the model's
float32; ``fp8_e4m3``: packed FP8 rows, a quarter of the bytes).

    python -m bench.context_flatness --model /work/models/smollm2-135m --kv-cache-dtype auto
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kernels.attention_metadata import build_attention_metadata
from workers.engine.kv_cache import allocate_kv_cache
from workers.models import load_model

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="/work/models/smollm2-135m")
    parser.add_argument("--contexts", default="64,512,2048")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="steps per length per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    model, arch = load_model(args.model, torch.float32, torch.device("cpu"))
    num_blocks = -(-max(contexts) // BLOCK_SIZE) + 1
    cache = allocate_kv_cache(
        num_blocks, arch.num_hidden_layers, arch.num_key_value_heads, BLOCK_SIZE,
        arch.head_dim, torch.float32, torch.device("cpu"), args.kv_cache_dtype,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    if cache.dtype == torch.uint8:
        from kernels.fp8_kv import quantize_rows

        cache.copy_(quantize_rows(torch.randn(*cache.shape[:-1], arch.head_dim, generator=gen)))
    else:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    table = np.arange(num_blocks, dtype=np.int32)[None, :]
    token = torch.tensor([42])

    def step(context: int) -> float:
        slot = context - 1  # the new token's K/V goes to the last position
        metadata = build_attention_metadata([1], [context], table, [slot], 1)
        positions = torch.tensor([context - 1])
        start = time.perf_counter()
        with torch.inference_mode():
            hidden = model(token, positions, cache, metadata)
            model.compute_logits(hidden)
        return time.perf_counter() - start

    for c in contexts:  # warm-up
        for _ in range(3):
            step(c)
    times: dict[int, list[float]] = {c: [] for c in contexts}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = contexts if r % 2 == 0 else contexts[::-1]
        for c in order:
            times[c].extend(step(c) for _ in range(args.steps))
    medians = {c: statistics.median(t) for c, t in times.items()}
    base = medians[contexts[0]]
    for c in contexts:
        print(
            f"kv {args.kv_cache_dtype:8s} context {c:5d}: step {medians[c] * 1e3:.2f} ms "
            f"({1 / medians[c]:.1f} tok/s), x{medians[c] / base:.3f} of context {contexts[0]}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": "python -m bench.context_flatness "
                    f"--kv-cache-dtype {args.kv_cache_dtype} --contexts {args.contexts} "
                    f"--rounds {args.rounds} --steps {args.steps}",
                    "machine": f"{platform.processor() or platform.machine()}, "
                    f"{os.cpu_count()} CPUs",
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                    "median_step_s": medians,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
