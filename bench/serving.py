"""Serving over gRPC: 1 prefill + 1 decode worker (disaggregated) against 2 aggregated
workers on one mixed workload, and the router's added latency per streamed token.

Both clusters are started here with the entry point of ``python -m cluster CONFIG``, as a
user would (plus the stamps, bench/serving_cluster.py), one after the other, with the same
model, block size, KV blocks and step budget.

- Load: N requests with token-id prompts from a few length buckets, max_tokens in
  [16, 128], greedy, EOS ignored, arriving as a Poisson process (``--rate``, one or
  more; 0 = all at once) with at most ``--max-concurrency`` in flight. Lengths and
  arrival times are the same in every repeat and configuration; token ids are fresh in
  every run (no prefix-cache hits). Per request, on the client's clock: TTFT (send -> first
  token), TPOT ((e2e - TTFT) / (tokens - 1)), the gaps between streamed chunks (ITL).
- Router overhead: one request at a time, alternately through the aggregated cluster
  and through an in-process ``LLMEngine`` with the workers' settings and torch threads.
  *Delivery*: client receive time minus the moment the worker's engine loop published
  the token, split where the router handled it (worker -> Ray -> router -> gRPC ->
  client). *Cadence*: client inter-chunk gap minus the direct engine's step time for the
  same request and token index. Every process reads the same ``time.monotonic`` clock;
  the cluster's stamps come from wrappers that ``bench/serving_stamps.py`` installs in the
  serving process and, through Ray's worker setup hook, in every worker; each appends
  (kind, request id, tokens, time) to a list.

    python -m bench.serving --rate 1.5 0.75 --repeats 3 --json bench/serving.json  # 14 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import grpc

from bench.serving_cluster import Cluster, Host
from bench.serving_overhead import DirectEngine, delivery, router_overhead
from bench.serving_stamps import wait_for_stamps
from bench.serving_stats import dist_ms, median_run
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]

PROMPT_LENS, MAX_TOKENS = (32, 128, 320, 600), (16, 128)  # prompt lengths, max_tokens range
MODES = ("disaggregated", "aggregated")
REQUEST_TIMEOUT_S = 300.0


# ---- workload and client -------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0


@dataclass
class Result:
    request_id: str
    send: float = 0.0
    recv: list[float] = field(default_factory=list)  # per message that carries tokens
    counts: list[int] = field(default_factory=list)  # tokens in each of those
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    kv_transfer_s: float = 0.0
    workers: str = ""
    error: str = ""


def make_workload(num: int, vocab: int, seed: int, rate: float, repeat: int) -> list[Item]:
    shape = random.Random(seed)  # lengths and arrivals: the same in every run
    content = random.Random(f"{seed}/{rate}/{repeat}")  # token ids: fresh in every run
    work, at = [], 0.0
    for _ in range(num):
        prompt_len, max_tokens = shape.choice(PROMPT_LENS), shape.randint(*MAX_TOKENS)
        work.append(Item(random_ids(content, prompt_len, vocab), max_tokens, at))
        at += shape.expovariate(rate) if rate > 0 else 0.0
    return work


def random_ids(rng: random.Random, num: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10, vocab) for _ in range(num))


async def generate(stub: pb_grpc.InferenceStub, request_id: str, item: Item) -> Result:
    req = pb.GenerateRequest(request_id=request_id)
    req.token_ids.ids.extend(item.prompt_ids)
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = item.max_tokens
    req.stopping.ignore_eos = True
    req.output.return_text = False
    req.output.return_timing = True
    res = Result(request_id, send=time.monotonic())
    try:
        async for msg in stub.Generate(req, timeout=REQUEST_TIMEOUT_S):
            now = time.monotonic()
            final = msg.final if msg.WhichOneof("kind") == "final" else None
            ids = final.delta.token_ids if final is not None else msg.delta.token_ids
            if ids:
                res.recv.append(now)
                res.counts.append(len(ids))
                res.token_ids.extend(ids)
            if final is not None:
                res.cached_tokens = final.usage.cached_prompt_tokens
                res.kv_transfer_s = final.timing.kv_transfer_seconds
                res.workers = f"{final.timing.prefill_worker or '-'}>{final.timing.decode_worker}"
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
    if not res.error and len(res.token_ids) != item.max_tokens:
        res.error = f"{len(res.token_ids)} tokens, asked for {item.max_tokens}"
    return res


async def run_load(address: str, work: list[Item], max_concurrency: int, tag: str):
    """Send ``work`` on its arrival schedule; returns (results, makespan seconds)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        slots = asyncio.Semaphore(max_concurrency)
        start = time.monotonic() + 0.05

        async def one(i: int, item: Item) -> Result:
            await asyncio.sleep(max(0.0, start + item.arrival_s - time.monotonic()))
            async with slots:
                return await generate(stub, f"{tag}-{i}", item)

        results = await asyncio.gather(*(one(i, item) for i, item in enumerate(work)))
    ends = [r.recv[-1] for r in results if r.recv]
    makespan = max(ends) - min(r.send for r in results) if ends else 0.0
    return list(results), makespan


def summarize(results: list[Result], makespan: float) -> dict:
    ok = [r for r in results if not r.error]
    per_s = 1 / makespan if makespan else 0.0
    itl = [
        (b - a) / n for r in ok for (a, b), n in zip(pairwise(r.recv), r.counts[1:], strict=True)
    ]
    return {
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if r.error}),
        "makespan_s": round(makespan, 3),
        "output_tok_s": round(sum(len(r.token_ids) for r in ok) * per_s, 2),
        "req_s": round(len(ok) * per_s, 3),
        "ttft_ms": dist_ms([r.recv[0] - r.send for r in ok]),
        "tpot_ms": dist_ms(
            [(r.recv[-1] - r.recv[0]) / (len(r.token_ids) - 1) for r in ok if len(r.token_ids) > 1]
        ),
        "itl_ms": dist_ms(itl),
        "e2e_ms": dist_ms([r.recv[-1] - r.send for r in ok]),
        "kv_transfer_ms": dist_ms([r.kv_transfer_s for r in ok if r.kv_transfer_s]),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "workers": dict(sorted(Counter(r.workers for r in ok).items())),
    }


# ---- router overhead: the engine called directly (serving_overhead.py) ------------
async def run_overhead(address: str, work: list[Item], engine: DirectEngine, tag: str):
    """One request at a time, alternately through the cluster and directly, so both see
    the same conditions over time. The first pair is a warm-up."""
    served, direct = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for i, item in enumerate(work):
            served.append(await generate(stub, f"{tag}-{i}", item))
            direct.append(engine.run(item))
    return served[1:], direct[1:]


# ---- the cluster -----------------------------------------------------------------------
def cluster_config(model_dir: str, mode: str, args: argparse.Namespace) -> dict:
    from workers.parallel.replica import free_port

    port = free_port("127.0.0.1")  # serving_cluster.Cluster needs it up front
    pool = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    disaggregated = mode == "disaggregated"
    return {
        "model": {"path": model_dir, "name": "bench", "max_model_len": args.max_model_len},
        "prefill": {"replicas": 1 if disaggregated else 0, **pool},
        "decode": {"replicas": 1 if disaggregated else 2, **pool},
        "kv_cache": {"block_size": args.block_size, "num_blocks": args.num_blocks},
        "kv_transfer": {"backend": "nixl"},
        "router": {
            "port": port,
            "http_port": 0,  # gRPC only
            "policy": "kv_aware",
            "disaggregation": "always" if disaggregated else "never",
            "max_queued_requests": 4 * args.num_requests,
            "drain_grace_seconds": 5,
        },
    }


# ---- one configuration -----------------------------------------------------------------
def measure(mode: str, model_dir: str, vocab: int, args: argparse.Namespace, host: Host) -> dict:
    """Bring the configuration up, warm it, run every load (and the overhead run on the
    aggregated cluster) ``--repeats`` times, interleaved; bring it down."""
    loads: dict[str, list] = {str(rate): [] for rate in args.rate}
    overhead = []
    with tempfile.TemporaryDirectory(prefix="baton-serving-") as tmp:
        host.wait_quiet(args.quiet_wait)
        started = time.monotonic()
        cluster = Cluster(cluster_config(model_dir, mode, args), Path(tmp))
        bring_up_s = time.monotonic() - started
        host.roots.append(cluster.process.pid)
        engine = None
        stamped: list[Result] = []  # every request whose stamps the analysis reads
        try:
            if mode == "aggregated" and args.overhead_requests:
                # What bring-up gives each of the 2 workers when it starts Ray itself.
                threads = max(1, (os.cpu_count() or 1) // 2)
                engine = DirectEngine(model_dir, args, threads)
            rng = random.Random(-1)
            warm = [Item(random_ids(rng, n, vocab), 8) for n in PROMPT_LENS * 2]
            results, _ = asyncio.run(run_load(cluster.address, warm, len(warm), "warm"))
            if any(r.error for r in results):
                raise RuntimeError(f"warm-up failed: {[r.error for r in results]}")
            for r in range(args.repeats):
                for rate in args.rate:
                    work = make_workload(args.num_requests, vocab, args.seed, rate, r)
                    quiet = host.wait_quiet(args.quiet_wait)
                    cpu0 = host.sample()
                    tag = f"{mode}-{rate}-r{r}"
                    results, makespan = asyncio.run(
                        run_load(cluster.address, work, args.max_concurrency, tag)
                    )
                    run = summarize(results, makespan)
                    run["foreign_cores_before"] = round(quiet, 2)
                    run["foreign_cpu_s"] = round(host.foreign_s(cpu0), 1)
                    run["worker_actors"] = host.count(cluster.process.pid, "ray::WorkerActor")
                    loads[str(rate)].append((run, results))
                    stamped += results
                    print(f"{mode} @ {rate} req/s, run {r}: {_line(run)}", flush=True)
                if engine is not None:
                    rng = random.Random(f"overhead/{args.seed}/{r}")
                    work = [
                        Item(random_ids(rng, args.overhead_prompt, vocab), args.overhead_tokens)
                        for _ in range(args.overhead_requests + 1)
                    ]
                    host.wait_quiet(args.quiet_wait)
                    cpu0 = host.sample()
                    pair = asyncio.run(run_overhead(cluster.address, work, engine, f"ovh-r{r}"))
                    overhead.append((pair, round(host.foreign_s(cpu0), 1)))
                    stamped += pair[0]
            stamps = wait_for_stamps(cluster.stamps_dir, stamped)
        finally:
            code = cluster.stop()
            host.roots.remove(cluster.process.pid)
        if code != 0:
            print("\n".join(cluster.lines[-40:]), file=sys.stderr)
            raise RuntimeError(f"{mode}: the cluster exited with {code}")
    out: dict = {"bring_up_s": round(bring_up_s, 1), "loads": {}}
    for rate, pairs in loads.items():
        runs = [{**run, **delivery(results, stamps)} for run, results in pairs]
        out["loads"][rate] = {"median": median_run(runs), "runs": runs}
    if overhead:
        runs = []
        for (served, direct), foreign in overhead:
            run = router_overhead(served, direct, stamps)
            run["foreign_cpu_s"], run["torch_threads"] = foreign, threads
            runs.append(run)
            print(f"overhead: {_overhead_line(run)}", flush=True)
        out["overhead"] = {"median": median_run(runs), "runs": runs}
    return out


def _line(run: dict) -> str:
    return (
        f"{run['req_s']:.2f} req/s, {run['output_tok_s']:.1f} tok/s | TTFT p50 "
        f"{run['ttft_ms']['p50']:.0f} p99 {run['ttft_ms']['p99']:.0f} ms | TPOT p50 "
        f"{run['tpot_ms']['p50']:.1f} p99 {run['tpot_ms']['p99']:.1f} ms | ITL p99 "
        f"{run['itl_ms']['p99']:.0f} ms | {run['num_ok']} ok | prompt tokens from the prefix "
        f"cache: {run['cached_prompt_tokens']} | others used {run['foreign_cpu_s']} core-s"
    )


def _overhead_line(run: dict) -> str:
    d, c = run["delivery_ms"], run["cadence_added_ms"]
    return (
        f"delivery p50 {d['p50']:.2f} p99 {d['p99']:.2f} ms (worker->router p50 "
        f"{run['worker_to_router_ms']['p50']:.2f}, router->client "
        f"{run['router_to_client_ms']['p50']:.2f}) | cadence added p50 {c['p50']:.2f} "
        f"p99 {c['p99']:.2f} ms | outputs differ: {run['outputs_differ_from_direct_engine']}"
        f" | others used {run['foreign_cpu_s']} core-s"
    )


# ---- report ----------------------------------------------------------------------------
ROWS = [("req/s", "req_s", None), ("output tok/s", "output_tok_s", None)]
ROWS += [
    (f"{name} {q} (ms)", key, q)
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"))
    for q in ("p50", "p90", "p99")
]
ROWS += [
    ("E2E p50 (ms)", "e2e_ms", "p50"),
    ("delivery p50 (ms)", "delivery_ms", "p50"),
    ("delivery p99 (ms)", "delivery_ms", "p99"),
]


def ratios(d: dict, a: dict) -> dict[str, float]:
    """Disaggregated / aggregated for every row of the table."""
    return {
        label: round((d[key] if q is None else d[key][q]) / (a[key] if q is None else a[key][q]), 3)
        for label, key, q in ROWS
    }


def print_tables(configs: dict) -> None:
    for rate in configs["disaggregated"]["loads"]:
        d, a = (configs[m]["loads"][rate]["median"] for m in MODES)
        print(f"\n{rate} req/s offered | disaggregated 1P+1D | aggregated 2x | D / A")
        for (label, key, q), ratio in zip(ROWS, ratios(d, a).values(), strict=True):
            dv, av = (d[key], a[key]) if q is None else (d[key][q], a[key][q])
            print(f"{label:>20} | {dv:10.2f} | {av:10.2f} | {ratio:.2f}x")
    if "overhead" in configs["aggregated"]:
        print("\nper streamed chunk, 1 request at a time | p50 | p99 | mean (ms)")
        for key, v in configs["aggregated"]["overhead"]["median"].items():
            if key.endswith("_ms"):
                print(f"{key:>28} | {v['p50']:8.3f} | {v['p99']:8.3f} | {v['mean']:8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model directory (default: make a small llama)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rate", type=float, nargs="+", default=[1.5], help="Poisson req/s")
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--overhead-requests", type=int, default=10, help="per repeat; 0 = skip")
    ap.add_argument("--overhead-prompt", type=int, default=64)
    ap.add_argument("--overhead-tokens", type=int, default=64)
    ap.add_argument("--quiet-wait", type=float, default=60.0, help="before each run (s)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.max_num_seqs < args.max_concurrency:
        ap.error("--max-num-seqs must be >= --max-concurrency")

    model_dir = Path(args.model) if args.model else ROOT / ".models/bench-small-llama"
    if not args.model and not (model_dir / "config.json").exists():
        from cluster.tools.make_model import make_model

        make_model(model_dir, "llama", "small", seed=args.seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    started, host = time.monotonic(), Host()
    configs = {mode: measure(mode, str(model_dir), vocab, args, host) for mode in MODES}
    print_tables(configs)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    work = make_workload(args.num_requests, vocab, args.seed, args.rate[0], 0)
    result = {
        "machine": f"{cpu or platform.processor()}, {os.cpu_count()} cores",
        "command": " ".join(["python", "-m", __spec__.name, *sys.argv[1:]]),
        "model_dir": str(model_dir),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workload": {
            "prompt_lens": PROMPT_LENS,
            "max_tokens": MAX_TOKENS,
            "prompt_tokens": sum(len(i.prompt_ids) for i in work),
            "output_tokens": sum(i.max_tokens for i in work),
        },
        "configs": configs,
        "ratio_disaggregated_over_aggregated": {
            rate: ratios(*(configs[m]["loads"][rate]["median"] for m in MODES))
            for rate in configs["disaggregated"]["loads"]
        },
        "total_s": round(time.monotonic() - started, 1),
    }
    print(f"\ntotal {result['total_s']} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
