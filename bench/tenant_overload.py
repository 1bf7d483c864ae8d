"""Per-key quotas (issue 35): while one key offers 5x the sustainable rate, another key's
requests are still served; its time to first token with and without the overload.

    python -m bench.tenant_overload [--factor 5] [--b-factor 0.35] [--seconds 15]
        [--max-queued 16] [--share 0.5] [--repeats 3] [--json out.json]

Serves ``python -m cluster CONFIG`` as bench/overload.py does (a Ray instance of its own,
1 prefill + 1 decode worker, a random-weight model, gRPC on loopback) with two API keys
(``router.api_keys_file``): A in tenant ``tenant-a``, B in ``tenant-b``;
``router.max_queued_requests`` is ``--max-queued`` and ``router.max_queued_share_per_key``
``--share``. After 5 s of warm-up load, the sustainable rate: a closed loop of
``max_queued`` gRPC clients, half with each key, completed requests per second over
``--seconds``. Then each of ``--repeats`` runs has two phases, idle then overload in even
runs, overload then idle in odd ones (ABBA): B offers ``--b-factor`` times the sustainable
rate in an open loop (evenly spaced sends, whatever has come back) for ``--seconds``,
streamed over gRPC; its TTFT is from the send to the first message that carries tokens.
In the overload phase A, from a process of its own (its sends do not wait on B's event
loop), offers ``--factor`` times the sustainable rate, from 1 s before B's window to 1 s
after it. Every request ends completed, refused (RESOURCE_EXHAUSTED, counted by the limit
its message names; for A the time from send to refusal is its time-to-refuse) or failed
(anything else); the most requests of a key in flight at once is as its client sees them.
The load average and the CPU other processes took are read around each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from statistics import median

import grpc
import yaml

from bench.overload import Served, cluster_config, grpc_request, offer, percentile, summarize
from bench.serving_cluster import Host
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
LEAD_S = 1.0  # A's overload starts this long before B's window and ends this long after
SPAWN_S = 2.0  # time for A's process to get its phase before the common start
# The limits a refusal names (router/quotas.py), the key's own first.
LIMITS = ("max_queued_share_per_key", "max_queued_requests", "requests_per_second_per_key")


def metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def one_keyed(stub, req, key: str) -> tuple[str, float, float | None]:
    """('ok' | 'refused: CODE (LIMIT)' | 'failed: CODE', seconds to the end or the refusal,
    seconds to the first message with tokens or None). LIMIT: the router's limit that the
    refusal names (router/quotas.py)."""
    start = time.perf_counter()
    first = None
    try:
        async for msg in stub.Generate(req, metadata=metadata(key), timeout=120):
            if first is None and (msg.delta.token_ids or msg.final.delta.token_ids):
                first = time.perf_counter() - start
        return "ok", time.perf_counter() - start, first
    except grpc.aio.AioRpcError as exc:
        end = time.perf_counter() - start
        if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            return f"failed: {exc.code().name}", end, None
        details = exc.details() or ""
        limit = next((name for name in LIMITS if name in details), "other")
        return f"refused: {exc.code().name} ({limit})", end, None


async def sustainable_rate(
    target: str, keys: list[str], clients: int, seconds: float, max_tokens: int
) -> tuple[float, int]:
    """Completed requests per second of a closed loop of ``clients`` gRPC clients, the
    keys taken in turn; and how many of its requests were refused."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        req = grpc_request(max_tokens)
        done = refused = 0
        end = time.monotonic() + seconds

        async def loop(key: str) -> None:
            nonlocal done, refused
            while time.monotonic() < end:
                outcome, _, _ = await one_keyed(stub, req, key)
                if outcome == "ok" and time.monotonic() <= end:
                    done += 1
                refused += outcome.startswith("refused")

        await asyncio.gather(*(loop(keys[i % len(keys)]) for i in range(clients)))
    return done / seconds, refused


async def offer_keyed(target, key, rate, seconds, start_at, max_tokens) -> tuple[list, int]:
    """Wait for ``start_at`` (time.time()), then the open loop of ``offer`` with ``key``;
    its outcomes and the most of its requests in flight at once (as this client sees them)."""
    await asyncio.sleep(max(0.0, start_at - time.time()))
    in_flight = most = 0

    async def send():
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            return await one_keyed(stub, req, key)
        finally:
            in_flight -= 1

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        req = grpc_request(max_tokens)
        return await offer(send, rate, seconds), most


def overload_a(target, key, rate, seconds, start_at, max_tokens) -> tuple[list, int]:
    """A's open loop, in A's own process (picklable results)."""
    return asyncio.run(offer_keyed(target, key, rate, seconds, start_at, max_tokens))


def refusals(outcomes: list[tuple[str, float, float | None]]) -> dict[str, int]:
    """Refusals by the limit they name."""
    return dict(Counter(o.split("(")[-1].rstrip(")") for o, _, _ in outcomes if "(" in o))


def summarize_b(outcomes: list[tuple[str, float, float | None]], most: int) -> dict:
    ttft = [first * 1000 for o, _, first in outcomes if o == "ok" and first is not None]
    e2e = [s * 1000 for o, s, _ in outcomes if o == "ok"]
    counts = summarize([(o, s) for o, s, _ in outcomes])
    return {
        **{k: counts[k] for k in ("offered", "completed", "refused", "failed", "failures")},
        "refused_by_limit": refusals(outcomes),
        "most_in_flight": most,
        "ttft_ms_p50": _round(percentile(ttft, 0.5)),
        "ttft_ms_p99": _round(percentile(ttft, 0.99)),
        "e2e_ms_p50": _round(percentile(e2e, 0.5)),
        "e2e_ms_p99": _round(percentile(e2e, 0.99)),
        "ttft_ms": [round(v, 2) for v in ttft],
    }


def phase(served: Served, host: Host, pool, keys: dict, rates: dict, args, overload: bool):
    """B's window for ``--seconds``; with ``overload``, A's 5x around it."""
    load = os.getloadavg()
    started = host.sample()
    start_at = time.time() + SPAWN_S
    pending = None
    if overload:
        a_seconds = args.seconds + 2 * LEAD_S
        a_args = (served.grpc, keys["a"], rates["a"], a_seconds, start_at, args.max_tokens)
        pending = pool.submit(overload_a, *a_args)
    b_at = start_at + (LEAD_S if overload else 0.0)
    b_out, b_most = asyncio.run(
        offer_keyed(served.grpc, keys["b"], rates["b"], args.seconds, b_at, args.max_tokens)
    )
    result = {"loadavg_before": [round(v, 2) for v in load], "b": summarize_b(b_out, b_most)}
    if pending is not None:
        a_out, a_most = pending.result()
        result["a"] = {
            **summarize([(o, s) for o, s, _ in a_out]),
            "refused_by_limit": refusals(a_out),
            "most_in_flight": a_most,
        }
    result["foreign_core_s"] = round(host.foreign_s(started), 1)
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def medians(runs: list[dict]) -> dict:
    """Medians over the runs of B's TTFT per condition, A's counts, and the ratios."""
    out = {}
    for cond in ("idle", "overload"):
        figures = ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "completed", "refused", "failed")
        for figure in figures:
            values = [r[cond]["b"][figure] for r in runs if r[cond]["b"][figure] is not None]
            out[f"b_{cond}_{figure}"] = _round(median(values)) if values else None
        pooled = [v for r in runs for v in r[cond]["b"]["ttft_ms"]]
        out[f"b_{cond}_ttft_ms_p99_pooled"] = _round(percentile(pooled, 0.99))
    for figure in ("offered", "completed", "refused", "failed", "refuse_ms_p50", "refuse_ms_p99"):
        values = [r["overload"]["a"][figure] for r in runs]
        values = [v for v in values if v is not None]
        out[f"a_{figure}"] = _round(median(values)) if values else None
    ratios = [r["b_ttft_p99_ratio"] for r in runs if r["b_ttft_p99_ratio"] is not None]
    out["b_ttft_p99_ratio_median"] = _round(median(ratios)) if ratios else None
    idle, over = out["b_idle_ttft_ms_p99_pooled"], out["b_overload_ttft_ms_p99_pooled"]
    out["b_ttft_p99_pooled_ratio"] = round(over / idle, 2) if idle and over else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=float, default=5.0, help="A: times the sustainable rate")
    parser.add_argument(
        "--b-factor", type=float, default=0.35, help="B: times the sustainable rate"
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="each phase's length")
    parser.add_argument("--max-queued", type=int, default=16, help="router.max_queued_requests")
    parser.add_argument("--share", type=float, default=0.5, help="router.max_queued_share_per_key")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="ABBA runs on the same cluster")
    parser.add_argument("--model", type=Path, default=None, help="default: a random small llama")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--server-log", type=Path, default=None, help="the cluster's output")
    args = parser.parse_args()
    model_dir = args.model or ROOT / ".models/bench-small-llama"
    if not (model_dir / "config.json").exists():
        from cluster.tools.make_model import make_model

        make_model(model_dir, "llama", "small", seed=0)
    keys = {"a": secrets.token_hex(16), "b": secrets.token_hex(16)}
    host = Host()
    runs = []
    # Spawned (not forked: grpc) once, and warmed, so that A's phases start on time.
    with (
        tempfile.TemporaryDirectory() as tmp,
        ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool,
    ):
        keys_file = Path(tmp) / "keys.yaml"
        entries = [{"name": n, "key": k, "tenant": f"tenant-{n}"} for n, k in keys.items()]
        keys_file.write_text(yaml.safe_dump({"keys": entries}))
        keys_file.chmod(0o600)
        config = cluster_config(model_dir, args.max_queued)
        config["router"].update(api_keys_file=str(keys_file), max_queued_share_per_key=args.share)
        pool.submit(time.sleep, 0).result()
        served = Served(config, Path(tmp))
        try:
            both = list(keys.values())
            # Warm-up (not measured): the first requests compile and fill caches.
            asyncio.run(sustainable_rate(served.grpc, both, args.max_queued, 5.0, args.max_tokens))
            load = os.getloadavg()
            rate, closed_refused = asyncio.run(
                sustainable_rate(served.grpc, both, args.max_queued, args.seconds, args.max_tokens)
            )
            rates = {"a": rate * args.factor, "b": rate * args.b_factor}
            for i in range(args.repeats):
                order = ("idle", "overload") if i % 2 == 0 else ("overload", "idle")
                run: dict = {"order": list(order)}
                for cond in order:
                    run[cond] = phase(
                        served, host, pool, keys, rates, args, overload=cond == "overload"
                    )
                idle, over = run["idle"]["b"]["ttft_ms_p99"], run["overload"]["b"]["ttft_ms_p99"]
                run["b_ttft_p99_ratio"] = round(over / idle, 2) if idle and over else None
                runs.append(run)
        finally:
            served.stop()
            if args.server_log:
                args.server_log.write_text("\n".join(served.lines) + "\n")
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {cpu_model()} (shared)",
        "command": " ".join(["python -m bench.tenant_overload", *sys.argv[1:]]),
        "max_queued_requests": args.max_queued,
        "max_queued_share_per_key": args.share,
        "max_tokens": args.max_tokens,
        "seconds": args.seconds,
        "loadavg_before_sustainable": [round(v, 2) for v in load],
        "sustainable_rps": round(rate, 2),
        "sustainable_refused": closed_refused,
        "a_offered_rps": round(rates["a"], 2),
        "b_offered_rps": round(rates["b"], 2),
        "runs": runs,
        **medians(runs),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
