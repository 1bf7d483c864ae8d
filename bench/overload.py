"""Overload (issue 25): at 5x the sustainable rate, requests past
``router.max_queued_requests`` are refused fast, the admitted ones finish, and the router's
memory stays bounded.

    python -m bench.overload [--factor 5] [--seconds 10] [--max-queued 16] [--json out.json]

Serves ``python -m cluster CONFIG`` (a Ray instance of its own, 1 prefill + 1 decode
worker, a random-weight model) with gRPC and HTTP; 5 s of load warm it up. Each of
``--repeats`` runs: first the sustainable rate: a closed
loop of ``max_queued`` clients over gRPC for ``--seconds``, completed requests per second.
Then, for gRPC and for HTTP in turn, an open loop offers ``factor`` times that rate
(evenly spaced sends, whatever has come back) for ``--seconds``; each request ends as
completed, refused (RESOURCE_EXHAUSTED / 429: the time from send to refusal is its
time-to-refuse) or failed (anything else). The router's RSS (the serving process's
VmRSS) is read before the run and after each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import grpc
import httpx2 as httpx

from bench.cluster_proc import ServedCluster, free_port
from bench.serving_cluster import Host
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


class Served(ServedCluster):
    """``python -m cluster CONFIG`` until :meth:`stop`; its gRPC and HTTP addresses."""

    def __init__(self, config: dict, workdir: Path):
        super().__init__(config, workdir, start_timeout_s=START_TIMEOUT_S)
        self.grpc = self.address
        self.http = self.http_url.removeprefix("http://")
        if not self.http:
            self.stop()
            raise RuntimeError("the cluster serves no HTTP API:\n" + "\n".join(self.lines))

    def rss_mib(self) -> float:
        """The router's (the serving process's) resident memory."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
        raise RuntimeError("no VmRSS")


def cluster_config(model_dir: Path, max_queued: int) -> dict:
    pool = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
    return {
        "model": {"path": str(model_dir), "name": "bench", "max_model_len": 512},
        "prefill": {"replicas": 1, **pool},
        "decode": {"replicas": 1, **pool},
        "kv_cache": {"block_size": 16, "num_blocks": 512},
        "kv_transfer": {"backend": "nixl"},
        "router": {
            "port": 0,
            "http_port": free_port(),  # 0 would mean no HTTP server
            "max_queued_requests": max_queued,
            "drain_grace_seconds": 5,
        },
        "metrics": {"port": 0},
    }


# ---- the two clients: one request each, its outcome ---------------------------------------


def grpc_request(max_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text=PROMPT)
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    req.output.return_text = False
    return req


async def one_grpc(stub, req: pb.GenerateRequest) -> tuple[str, float]:
    """('ok' | 'refused' | 'failed: CODE', seconds from send to the end or the refusal)."""
    start = time.perf_counter()
    try:
        async for _ in stub.Generate(req, timeout=120):
            pass
        return "ok", time.perf_counter() - start
    except grpc.aio.AioRpcError as exc:
        outcome = "refused" if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"
        return f"{outcome}: {exc.code().name}", time.perf_counter() - start


async def one_http(client: httpx.AsyncClient, body: dict) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        answer = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return f"failed: {type(exc).__name__}", time.perf_counter() - start
    status = answer.status_code
    outcome = "ok" if status == 200 else "refused" if status == 429 else "failed"
    return f"{outcome}: {status}", time.perf_counter() - start


# ---- phases --------------------------------------------------------------------------------


async def sustainable_rate(target: str, clients: int, seconds: float, max_tokens: int) -> float:
    """Completed requests per second of a closed loop of ``clients`` gRPC clients."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        req = grpc_request(max_tokens)
        done = 0
        end = time.monotonic() + seconds

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                outcome, _ = await one_grpc(stub, req)
                if outcome == "ok" and time.monotonic() <= end:
                    done += 1

        await asyncio.gather(*(loop() for _ in range(clients)))
    return done / seconds


async def offer(send, rate: float, seconds: float) -> list[tuple[str, float]]:
    """Open loop: ``send()`` every 1/rate s for ``seconds``, whatever has come back."""
    tasks = []
    start = time.monotonic()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send()))
    return list(await asyncio.gather(*tasks))


async def overload_grpc(target: str, rate: float, seconds: float, max_tokens: int):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        req = grpc_request(max_tokens)
        return await offer(lambda: one_grpc(stub, req), rate, seconds)


async def overload_http(base_url: str, rate: float, seconds: float, max_tokens: int):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        return await offer(lambda: one_http(client, body), rate, seconds)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(outcomes: list[tuple[str, float]]) -> dict:
    refused = [s * 1000 for o, s in outcomes if o.startswith("refused")]
    failed = sorted({o for o, _ in outcomes if o.startswith("failed")})
    return {
        "offered": len(outcomes),
        "completed": sum(o.startswith("ok") for o, _ in outcomes),
        "refused": len(refused),
        "failed": sum(o.startswith("failed") for o, _ in outcomes),
        "failures": failed,
        "refuse_ms_p50": percentile(refused, 0.5),
        "refuse_ms_p99": percentile(refused, 0.99),
        "refuse_ms_max": max(refused, default=None),
    }


def one_run(served: Served, host: Host, args) -> dict:
    """The sustainable rate, then ``factor`` times it over gRPC, then over HTTP."""
    rss = {"start": served.rss_mib()}
    started = host.sample()
    rate = asyncio.run(
        sustainable_rate(served.grpc, args.max_queued, args.seconds, args.max_tokens)
    )
    rss["after_sustainable"] = served.rss_mib()
    offered = rate * args.factor
    grpc_out = asyncio.run(overload_grpc(served.grpc, offered, args.seconds, args.max_tokens))
    rss["after_grpc_overload"] = served.rss_mib()
    http_out = asyncio.run(
        overload_http(f"http://{served.http}", offered, args.seconds, args.max_tokens)
    )
    rss["after_http_overload"] = served.rss_mib()
    return {
        "sustainable_rps": round(rate, 2),
        "offered_rps": round(offered, 2),
        "grpc": summarize(grpc_out),
        "http": summarize(http_out),
        "router_rss_mib": rss,
        "foreign_core_s": host.foreign_s(started),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=float, default=5.0, help="times the sustainable rate")
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's length")
    parser.add_argument("--max-queued", type=int, default=16, help="router.max_queued_requests")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs on the same cluster")
    parser.add_argument("--model", type=Path, default=None, help="default: a random small llama")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = args.model or ROOT / ".models/bench-small-llama"
    if not (model_dir / "config.json").exists():
        from cluster.tools.make_model import make_model

        make_model(model_dir, "llama", "small", seed=0)
    host = Host()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        served = Served(cluster_config(model_dir, args.max_queued), Path(tmp))
        try:
            # Warm-up (not measured): the first requests compile and fill caches.
            asyncio.run(sustainable_rate(served.grpc, args.max_queued, 5.0, args.max_tokens))
            for _ in range(args.repeats):
                runs.append(one_run(served, host, args))
        finally:
            served.stop()
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} cores (shared, noisy)",
        "command": " ".join(["python -m bench.overload", *sys.argv[1:]]),
        "max_queued_requests": args.max_queued,
        "max_tokens": args.max_tokens,
        "runs": runs,
    }
    for api in ("grpc", "http"):
        for figure in ("refuse_ms_p50", "refuse_ms_p99"):
            values = [run[api][figure] for run in runs if run[api][figure] is not None]
            result[f"{api}_{figure}_median"] = median(values) if values else None
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
