"""Requests one fixed KV-cache memory holds: a DeepSeek-V3-shaped model (MLA: one latent
row per token and layer) against a Llama model (GQA: K and V per kv head) of the same size
class, measured from the engine (issue 39).

For each model and KV dtype the engine sizes its cache from the same budget
(``kv_cache_memory_gib``; CPU, prefix caching off), and requests of ``--prompt-len``
random prompt tokens and ``--max-tokens`` greedy outputs (EOS ignored; by default one:
each request's KV stays at its prompt's length, so nothing grows and nothing is
preempted) are added at once, a quarter more than the cache's blocks hold. The step's
token budget and ``max_num_seqs`` are far above them, so the blocks alone decide how many
run. Just before each step's forward (``before_forward``: the step's blocks are
allocated, none freed yet) the requests holding blocks (``block_manager.has_request``)
are counted: the peak is the number of requests the cache held at once. Bytes per
token are the allocated cache's bytes over its token slots.

    baton make-model /tmp/ds-small --arch deepseek-v3 --size small --dtype float32
    baton make-model /tmp/llama-small --arch llama --size small --dtype float32
    python -m bench.mla_capacity --json bench/mla_capacity.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine


def measure(model: str, kv_dtype: str, args: argparse.Namespace) -> dict:
    """One engine's cache size and the most requests it held at once."""
    config = EngineConfig(
        model=model, dtype="float32", device="cpu", kv_cache_dtype=kv_dtype,
        kv_cache_memory_gib=args.budget_mib / 1024, enable_prefix_caching=False,
        max_num_seqs=2048, max_num_batched_tokens=32768,
        max_model_len=args.prompt_len + args.max_tokens, detokenize=False,
    )  # fmt: skip
    held: list[int] = []
    engine = LLMEngine(
        config, before_forward=lambda _: held.append(sum(map(manager.has_request, ids)))
    )
    manager = engine.block_manager
    blocks_per_request = -(-(args.prompt_len + args.max_tokens) // config.block_size)
    num_requests = manager.num_blocks * 5 // (4 * blocks_per_request) + 2
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request([rng.randrange(2, 8000) for _ in range(args.prompt_len)], params)
        for _ in range(num_requests)
    ]
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    manager.check_integrity()
    num_blocks = manager.num_blocks
    cache_bytes = engine.kv_cache.numel() * engine.kv_cache.element_size()
    return {
        "model": model,
        "kv_cache_dtype": kv_dtype,
        "cache_shape": list(engine.kv_cache.shape),
        "cache_bytes": cache_bytes,
        "num_blocks": num_blocks,
        "token_slots": num_blocks * config.block_size,
        "bytes_per_token": cache_bytes / (num_blocks * config.block_size),
        "blocks_per_request": blocks_per_request,
        "full_length_requests": num_blocks // blocks_per_request,
        "num_requests": num_requests,
        "peak_requests_held": max(held),
        "preemptions": engine.scheduler.num_preemptions,
        "steps": len(held),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="/tmp/ds-small,/tmp/llama-small")
    parser.add_argument("--kv-dtypes", default="auto,fp8_e4m3")
    parser.add_argument("--budget-mib", type=float, default=8.0)
    parser.add_argument("--prompt-len", type=int, default=63)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loads, results = [], []
    for kv_dtype in args.kv_dtypes.split(","):
        for model in args.models.split(","):
            loads.append(os.getloadavg()[0])
            res = measure(model, kv_dtype, args)
            results.append(res)
            print(
                f"{Path(model).name:12s} {kv_dtype:9s} {res['num_blocks']:5d} blocks "
                f"{res['bytes_per_token']:8.0f} B/token  held {res['peak_requests_held']:3d} of "
                f"{res['num_requests']} requests ({res['full_length_requests']} at full length;"
                f" {res['preemptions']} preemptions, {res['seconds']:.0f} s)",
                flush=True,
            )
    if args.json:
        out = {
            "command": "python -m bench.mla_capacity " + " ".join(sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "loadavg_1min_before_each_run": loads,
            "results": results,
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
