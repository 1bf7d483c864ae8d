"""TTFT of a prompt whose prefix a KV tier holds: onboarded synchronously at admission
against layer-wise while the first chunk computes (docs/kv-tiers.md, "Layer-wise
onboarding").

One engine per mode (``kv_tier_onboard`` off / on), each with its own disk directory. Each
repeat, per mode, in turn: the pool and the host memory above the disk forget the prefix
(only the disk holds it, and ``--cold`` drops its files from the page cache), then one
request of the prefix plus a fresh suffix is timed from ``add_request`` to its first token.
Medians of ``--repeats``; the modes alternate within each repeat.

    python -m bench.kv_onboard --prefix 2048 --suffix 64 --repeats 3 --cold
    python -m bench.kv_onboard --tier host --prefix 256   # a small host-tier hit
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from workers import LLM, SamplingParams
from workers.engine.kv_tiers import build

BLOCK = 16
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def make_engine(model_dir: Path, tier: str, mode: str, workdir: Path) -> LLM:
    tiers = {"kv_host_tier_gib": 1.0}
    if tier == "disk":
        tiers = {"kv_disk_tier_path": str(workdir / mode)}
    return LLM(
        str(model_dir), dtype="float32", block_size=BLOCK, max_num_batched_tokens=4096,
        kv_tier_onboard=mode, **tiers,
    )  # fmt: skip


def forget(llm: LLM, tier: str, cold: bool) -> None:
    """Only the tier under test holds the prefix now."""
    tiers = llm.engine.kv_tiers
    llm.engine.block_manager.evict()
    tiers.wait_idle()
    if tier == "host":
        return
    staging = tiers._lookup[0]
    for junk in range(staging.capacity_blocks):
        staging.put(junk, torch.zeros(staging.block_bytes, dtype=torch.uint8))
    if cold:  # only this bench's files leave the page cache
        disk = tiers.tiers[-1]
        for entry in os.scandir(disk.directory):
            fd = os.open(entry.path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def ttft_s(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """Seconds to the first token, and the request's onboarding (admission to the last
    block in the pool)."""
    engine = llm.engine
    t0 = time.perf_counter()
    req = engine.scheduler.requests[engine.add_request(prompt, FIRST)]
    while engine.has_unfinished_requests():
        if any(d.token_ids for d in engine.step()):
            elapsed = time.perf_counter() - t0
            while engine.has_unfinished_requests():
                engine.step()
            start_ns, end_ns = req.onboard_ns or (0, 0)
            return elapsed, (end_ns - start_ns) / 1e9
    raise RuntimeError("no token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: make small)")
    parser.add_argument("--tier", choices=["disk", "host"], default="disk")
    parser.add_argument("--prefix", type=int, default=2048, help="prefix tokens on the tier")
    parser.add_argument("--suffix", type=int, default=64, help="tokens computed after it")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    parser.add_argument("--cold", action="store_true", help="drop the files from page cache")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kv_onboard_"))
    model_dir = args.model
    if model_dir is None:
        from cluster.tools.make_model import make_model

        model_dir = make_model(workdir / "small", "llama", "small", dtype="float32")
    build.STAGING_BYTES = 64 * 2**20  # the disk's host staging, flooded by ``forget``
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(args.prefix)]
    modes = ("off", "on")
    engines = {mode: make_engine(model_dir, args.tier, mode, workdir) for mode in modes}
    for llm in engines.values():  # compute the prefix once: the tier gets it
        llm.generate([prefix + [1] * BLOCK], FIRST)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    onboard: dict[str, list[float]] = {mode: [] for mode in modes}
    # Warm-up rounds first: an engine's first requests touch pool pages for the first time.
    for repeat in range(-args.warmup, args.repeats):
        suffix = [rng.randrange(1000) for _ in range(args.suffix)]
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            forget(engines[mode], args.tier, args.cold)
            ttft, onboard_s = ttft_s(engines[mode], prefix + suffix)
            if repeat >= 0:
                times[mode].append(ttft)
                onboard[mode].append(onboard_s)
    onboarded = {m: e.engine.kv_tiers.stats().onboarded for m, e in engines.items()}
    result = {
        "tier": args.tier,
        "cold": args.cold,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "block_bytes": engines["on"].engine.kv_tiers.block_bytes,
        "ttft_ms": {m: [round(t * 1e3, 1) for t in ts] for m, ts in times.items()},
        "median_ms": {m: round(statistics.median(ts) * 1e3, 1) for m, ts in times.items()},
        # sync: the copy at admission; layer-wise: admission to the step's join
        "onboard_ms": {m: [round(t * 1e3, 1) for t in ts] for m, ts in onboard.items()},
        "onboarded_blocks": onboarded,
        "load": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
