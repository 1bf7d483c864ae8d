"""Data-parallel attention against tensor-parallel attention for a MoE decode pool.

Two measurements (docs/moe.md, "Data-parallel attention"):

- ``capacity``: the KV a rank holds at a fixed memory budget, by the engine's own sizing
  (``resolve_num_blocks`` with the heads each layout keeps per rank): a TP=N replica's rank
  keeps its share of the heads (MLA: the whole latent row, replicated; GQA with fewer KV
  heads than ranks: one head, replicated) of *every* request, a DP=N group's rank all
  heads of *its own* requests. Reported as requests of ``--request-len`` tokens the
  N ranks hold together, for the small make-models and, from their published shapes,
  DeepSeek-V3 and Qwen3-30B-A3B at N = 2 and 8 (bfloat16, ``--real-memory-gib`` a rank).
- ``decode``: decode tokens/s of ``--batch`` requests on 2 gloo ranks of this CPU (1
  thread each): a TP=2 EP=2 replica (rank 0 schedules all, rank 1 follows) against a DP=2
  EP=2 group (half the requests each). Rounds alternate the order; medians reported. The
  decode window: from the step after every request's first token to the last token.

    python -m bench.dp_attention --rounds 3 --json bench/dp_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

# Published shapes (config.json): (layers, KV heads cached, head dim, entries per token).
REAL_MODELS = {
    "DeepSeek-V3 (MLA latent 512+64)": (61, 1, 576, 1, True),
    "Qwen3-30B-A3B (GQA, 4 KV heads x 128)": (48, 4, 128, 2, False),
}


def _bytes_per_token(layers: int, heads: int, head_dim: int, entries: int, dtype_bytes=2) -> int:
    return layers * heads * head_dim * entries * dtype_bytes


def _tp_heads(total_heads: int, ranks: int, replicated: bool) -> int:
    """KV heads one TP rank caches (ParallelContext.kv_heads; MLA's one latent replicated)."""
    if replicated or ranks >= total_heads:
        return 1
    return total_heads // ranks


def capacity(
    model_dirs: dict[str, str], memory_gib: float, real_memory_gib: float, request_len: int
) -> list[dict]:
    from workers.engine.cache_sizing import resolve_num_blocks
    from workers.engine.config import EngineConfig
    from workers.models.arch_config import ArchConfig
    from workers.models.parallel import ParallelContext

    rows = []
    for name, path in model_dirs.items():
        arch = ArchConfig.from_model_dir(path)
        config = EngineConfig(
            model=path, dtype="float32", device="cpu", kv_cache_memory_gib=memory_gib,
            max_num_seqs=4096, max_num_batched_tokens=4096, max_model_len=request_len,
        )  # fmt: skip
        heads_tp, _ = ParallelContext(tp_rank=0, tp_size=2).kv_heads(arch.kv_cache_heads)
        sizes = {}
        for layout, heads in (("tp", heads_tp), ("dp", arch.kv_cache_heads)):
            sizes[layout] = resolve_num_blocks(
                config, arch, torch.float32, torch.device("cpu"), request_len, heads
            )
        per_request = -(-request_len // config.block_size)
        tp_requests = sizes["tp"] // per_request  # one cache for the replica's requests
        dp_requests = 2 * (sizes["dp"] // per_request)  # each rank its own
        rows.append(
            dict(model=name, ranks=2, kv_heads=arch.kv_cache_heads, tp_heads_per_rank=heads_tp,
                 tp_blocks_per_rank=sizes["tp"], dp_blocks_per_rank=sizes["dp"],
                 tp_requests=tp_requests, dp_requests=dp_requests,
                 ratio=dp_requests / max(tp_requests, 1))
        )  # fmt: skip
    for name, (layers, heads, head_dim, entries, replicated) in REAL_MODELS.items():
        full = _bytes_per_token(layers, heads, head_dim, entries)
        budget = int(real_memory_gib * 2**30)  # bfloat16 KV of a GPU rank
        for ranks in (2, 8):
            tp = _bytes_per_token(layers, _tp_heads(heads, ranks, replicated), head_dim, entries)
            tp_requests = budget // (tp * request_len)
            dp_requests = ranks * (budget // (full * request_len))
            rows.append(
                dict(model=name, ranks=ranks, kv_heads=heads,
                     tp_heads_per_rank=_tp_heads(heads, ranks, replicated),
                     tp_bytes_per_token_per_rank=tp, dp_bytes_per_token_per_rank=full,
                     tp_requests=tp_requests, dp_requests=dp_requests,
                     ratio=dp_requests / max(tp_requests, 1))
            )  # fmt: skip
    return rows


def _engine_config(model: str, dp: bool):
    from workers.engine.config import EngineConfig

    return EngineConfig(
        model=model, dtype="float32", device="cpu", max_model_len=256, block_size=16,
        num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=512, detokenize=False,
        expert_parallel=2, expert_dispatch="alltoall",
    )  # fmt: skip


def _drive(engine, step, is_done, prompts, max_tokens: int) -> dict:
    """Add ``prompts``, step until ``is_done``; the decode window's tokens and seconds."""
    from workers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts:
        engine.add_request(prompt, params, rid)
    counts = {rid: 0 for rid, _ in prompts}
    start = None
    window_tokens = 0
    while True:
        deltas = step()
        now = time.perf_counter()
        for d in deltas:
            counts[d.request_id] += len(d.token_ids)
            if start is not None:
                window_tokens += len(d.token_ids)
        if start is None and all(counts.values()):
            start = now  # every request has its first token: decode only from here
        if is_done():
            break
    return {"tokens": window_tokens, "start": start, "end": now}


def _rank(rank: int, mode: str, port: int, model: str, batch: int, max_tokens: int, out: str):
    torch.set_num_threads(1)
    vocab = 1000
    prompts = [
        (f"r{i}", [(37 * i + 11 * j) % (vocab - 1) + 1 for j in range(32)]) for i in range(batch)
    ]
    if mode == "dp":
        from workers.parallel.dp_group import DpEngine, join_dp_group
        from workers.parallel.replica import leave_replica

        parallel, lockstep = join_dp_group(rank, 2, "127.0.0.1", port, "cpu")
        try:
            dp = DpEngine(_engine_config(model, True), parallel, lockstep)
            result = _drive(dp.engine, dp.step, lambda: dp.is_idle, prompts[rank::2], max_tokens)
        finally:
            leave_replica()
    else:
        import tests.workers.test_tensor_parallel as harness
        from tests.workers.test_tensor_parallel import rank0_engine
        from workers.engine.llm_engine import LLMEngine
        from workers.parallel.replica import agree_min, join_replica, leave_replica
        from workers.parallel.replica_follower import RankFollower

        harness._config = lambda path: _engine_config(path, False)
        parallel, link = join_replica(rank, 2, "127.0.0.1", port, "cpu")
        try:
            if rank == 0:
                kv, engine = rank0_engine(model, parallel, link, lambda *_: None)
                result = _drive(
                    engine, engine.step, lambda: not engine.has_unfinished_requests(), prompts,
                    max_tokens,
                )  # fmt: skip
                kv.close()
            else:
                engine = LLMEngine(
                    _engine_config(model, False), parallel=parallel,
                    agree_num_blocks=agree_min(link),
                )  # fmt: skip
                RankFollower(engine, link).run()
                result = {"tokens": 0, "start": None, "end": None}
        finally:
            leave_replica()
    Path(out, f"{mode}{rank}.json").write_text(json.dumps(result))


def decode_round(mode: str, model: str, batch: int, max_tokens: int) -> float:
    from workers.parallel.replica import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank, args=(mode, free_port("127.0.0.1"), model, batch, max_tokens, out),
            nprocs=2, join=True, start_method="spawn",
        )  # fmt: skip
        parts = [json.loads(Path(out, f"{mode}{r}.json").read_text()) for r in (0, 1)]
    parts = [p for p in parts if p["start"] is not None]
    seconds = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    return sum(p["tokens"] for p in parts) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--memory-gib", type=float, default=0.25, help="KV per rank, small")
    parser.add_argument("--real-memory-gib", type=float, default=40.0, help="KV per GPU rank")
    parser.add_argument("--request-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--archs", default="qwen3-moe,deepseek-v3")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    from cluster.tools.make_model import make_model

    work = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    models = {a: str(make_model(work / a, a, args.size)) for a in args.archs.split(",")}
    report: dict = {
        "capacity": capacity(models, args.memory_gib, args.real_memory_gib, args.request_len)
    }
    for row in report["capacity"]:
        print(json.dumps(row), flush=True)
    report["decode"] = {}
    for arch, path in models.items():
        runs: dict[str, list[float]] = {"tp": [], "dp": []}
        for i in range(args.rounds):
            for mode in ("tp", "dp") if i % 2 == 0 else ("dp", "tp"):
                runs[mode].append(decode_round(mode, path, args.batch, args.max_tokens))
                print(f"{arch} round {i} {mode}: {runs[mode][-1]:.1f} tok/s", flush=True)
        medians = {m: statistics.median(v) for m, v in runs.items()}
        report["decode"][arch] = {"runs": runs, "median": medians}
        print(f"{arch}: median tok/s tp {medians['tp']:.1f}, dp {medians['dp']:.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
