"""What offloading costs the step loop: the same decode-heavy run with KV tiers off and on.

With a host tier (G2), every block the pool evicts is copied into it on the engine thread
while scheduling (docs/kv-tiers.md, "Offload"). This runs a workload that keeps the pool
under pressure — every request's prompt is new, so admission evicts finished requests'
cached blocks all the time — but never preempts (the pool holds ``max_num_seqs``
full-length requests) and never finds a block in the tier (fresh random prompts each
repeat), so the two engines compute exactly the same tokens and differ only by the
offloads. Repeats alternate off / on; each reports the engine thread's CPU time per step
(the process's CPU time, all torch threads included: steadier than wall time on a
shared machine) and wall time per step; the result is the
median of the per-repeat on/off ratios. The offload copies are also timed where they
happen (``HostTier.put``), per step, and one put is timed against a plain copy of the same
bytes at three block sizes.

    baton make-model /tmp/small --arch llama --size small
    python -m bench.kv_tier_offload --model /tmp/small --repeats 5 --json bench/kv_tier_offload.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from workers import LLM, SamplingParams
from workers.engine.kv_tiers.host_tier import HostTier
from workers.engine.kv_tiers.keys import CacheFingerprint


def workload(seed: int, num: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(32, 128))] for _ in range(num)]
    params = [
        SamplingParams(max_tokens=rng.randint(64, 160), temperature=0.0, ignore_eos=True)
        for _ in range(num)
    ]
    return prompts, params


def timed_run(llm: LLM, prompts, params) -> dict:
    engine = llm.engine
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    tiers = engine.kv_tiers
    offloaded0 = tiers.stats().offloaded if tiers else 0
    host_s0 = tiers.tiers[0].stats().offload_seconds if tiers else 0.0
    preempt0 = engine.scheduler.num_preemptions
    steps, tokens = 0, 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(d.token_ids) for d in engine.step())
        steps += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert engine.scheduler.num_preemptions == preempt0, "the pool must not preempt"
    return {
        "steps": steps,
        "tokens": tokens,
        "cpu_ms_per_step": 1e3 * cpu / steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "offloaded_blocks": (tiers.stats().offloaded - offloaded0) if tiers else 0,
        "offload_ms": 1e3 * ((tiers.tiers[0].stats().offload_seconds - host_s0) if tiers else 0),
    }


def put_cost_us(block_bytes: int, num: int = 200) -> tuple[float, float]:
    """(median µs of one ``HostTier.put`` of a new block into a full tier, median µs of a
    plain copy of as many bytes): what one eviction costs the engine thread."""
    fp = CacheFingerprint("bench", "uint8", "auto", 1, 1, 1, 16)
    tier = HostTier(fp, block_bytes, 64 * block_bytes)
    src = torch.randint(0, 255, (block_bytes,), dtype=torch.uint8)
    dst = torch.ones((64, block_bytes), dtype=torch.uint8)  # as many as the tier: as cold
    for h in range(64):  # full: every timed put evicts
        tier.put(h, src)
    puts, copies = [], []
    for h in range(64, 64 + num):
        t0 = time.perf_counter()
        tier.put(h, src)
        t1 = time.perf_counter()
        dst[h % 64].copy_(src)
        copies.append(time.perf_counter() - t1)
        puts.append(t1 - t0)
    return 1e6 * statistics.median(puts), 1e6 * statistics.median(copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--host-gib", type=float, default=0.0625)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    block = 16
    # Room for max_num_seqs requests of the longest prompt + output: no preemption.
    num_blocks = args.max_num_seqs * -(-(128 + 160) // block)
    common = dict(
        dtype="float32",
        block_size=block,
        num_kv_blocks=num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=512,
    )
    engines = {
        "off": LLM(args.model, **common),
        "on": LLM(args.model, **common, kv_host_tier_gib=args.host_gib),
    }
    vocab = engines["off"].engine.vocab_size
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(args.repeats + 1):  # the first is a warm-up, not counted
        prompts, params = workload(rep, args.requests, vocab)
        for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            result = timed_run(engines[name], prompts, params)
            if rep:
                runs[name].append(result)
            print(rep, name, result, flush=True)
    ratios = {
        key: [on[key] / off[key] for on, off in zip(runs["on"], runs["off"], strict=True)]
        for key in ("cpu_ms_per_step", "wall_ms_per_step")
    }
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "model": args.model,
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "num_kv_blocks": num_blocks,
        "runs": runs,
        "median_ratio_cpu_per_step": statistics.median(ratios["cpu_ms_per_step"]),
        "median_ratio_wall_per_step": statistics.median(ratios["wall_ms_per_step"]),
        "ratios": ratios,
        "offloaded_blocks_per_step": statistics.median(
            r["offloaded_blocks"] / r["steps"] for r in runs["on"]
        ),
        "offload_ms_per_step": statistics.median(r["offload_ms"] / r["steps"] for r in runs["on"]),
        # The offload copies timed where they happen (HostTier.put), against the step: the
        # figure the machine's noise does not swamp.
        "offload_share_of_step": statistics.median(
            r["offload_ms"] / r["steps"] / r["wall_ms_per_step"] for r in runs["on"]
        ),
    }
    # One eviction at real models' block sizes (blocks of 16 tokens): the tiny model's
    # (8 KiB), the small one's in float32 (320 KiB), an 8B model's in bfloat16 (2 MiB).
    summary["put_us_vs_copy_us"] = {
        size: put_cost_us(size) for size in (8 << 10, 320 << 10, 2 << 20)
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
