"""What tracing costs: throughput and the router's CPU per output token with tracing off,
at 1 % and at 100 % kept (docs/tracing.md).

Each configuration is a served cluster (``python -m cluster``: 1 prefill + 1 decode worker,
``disaggregation: always``, the tiny model so that the router's share of the work is as
large as it gets) started fresh, in an order that alternates over rounds. Tracing on, its
kept traces go over OTLP/HTTP to a receiver in this process that decodes nothing and
answers 200 (the export's encoding and sending are counted; a collector's work is not).
Per run: ``--requests`` gRPC requests of ``--max-tokens`` tokens (greedy, EOS ignored) at
``--concurrency``, after a warm-up; throughput = output tokens / wall seconds, and the
serving process's (the router's) CPU seconds from /proc over the same interval, per
output token. Medians over rounds.

    python -m bench.tracing --rounds 3 --json bench/tracing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from bench.cluster_proc import ServedCluster
from cluster.tools.make_model import make_model
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

MODES = {"off": None, "1%": 0.01, "100%": 1.0}
PROMPT = "Tracing a request through a disaggregated cluster, step by step: "


class Sink:
    """An OTLP/HTTP endpoint that counts what arrives and answers 200."""

    def __init__(self):
        self.num_exports = 0
        self.num_bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                sink.num_exports += 1
                sink.num_bytes += len(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def config(model_dir: Path, ratio: float | None, endpoint: str) -> dict:
    cfg = {
        "model": {"path": str(model_dir), "name": "tiny", "max_model_len": 512},
        "prefill": {"replicas": 1, "max_num_seqs": 32},
        "decode": {"replicas": 1, "max_num_seqs": 32},
        "kv_cache": {"block_size": 16, "num_blocks": 1024},
        "router": {"port": 0, "http_port": 0, "disaggregation": "always"},
        "metrics": {"enabled": False},
    }
    if ratio is not None:
        cfg["tracing"] = {"enabled": True, "endpoint": endpoint, "sample_ratio": ratio}
    return cfg


async def load(address: str, num: int, concurrency: int, max_tokens: int) -> int:
    """Send ``num`` requests, ``concurrency`` at a time; the output tokens received."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            req = pb.GenerateRequest(text=f"{PROMPT}{i}")
            req.stopping.max_tokens = max_tokens
            req.stopping.ignore_eos = True
            req.sampling.temperature = 0.0
            async with gate:
                tokens = 0
                async for msg in stub.Generate(req, timeout=300):
                    body = msg.delta if msg.WhichOneof("kind") == "delta" else msg.final.delta
                    tokens += len(body.token_ids)
                return tokens

        return sum(await asyncio.gather(*(one(i) for i in range(num))))


def run_once(model_dir: Path, mode: str, sink: Sink, args) -> dict:
    with tempfile.TemporaryDirectory() as work:
        served = ServedCluster(config(model_dir, MODES[mode], sink.endpoint), Path(work))
        try:
            asyncio.run(load(served.address, 8, 8, 8))  # warm-up: every path once
            pid = served.process.pid
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            tokens = asyncio.run(
                load(served.address, args.requests, args.concurrency, args.max_tokens)
            )
            wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
        finally:
            served.stop()
    return {
        "mode": mode,
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "router_cpu_s": cpu,
        "router_cpu_us_per_token": cpu / tokens * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sink = Sink()
    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    make_model(model_dir, "llama", "tiny")
    runs = []
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for mode in order:
            load_before = os.getloadavg()[0]
            row = run_once(model_dir, mode, sink, args)
            row.update(round=r, load_avg_before=load_before)
            runs.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for mode in MODES:
        rows = [x for x in runs if x["mode"] == mode]
        summary[mode] = {
            "tok_per_s": statistics.median(x["tok_per_s"] for x in rows),
            "router_cpu_us_per_token": statistics.median(
                x["router_cpu_us_per_token"] for x in rows
            ),
        }
    # Ratios to "off" within each round (the same minutes of the machine's load), then
    # their median: steadier than a ratio of medians on a noisy machine.
    off_of = {x["round"]: x for x in runs if x["mode"] == "off"}
    for mode, row in summary.items():
        rows = [x for x in runs if x["mode"] == mode]
        row["throughput_vs_off"] = statistics.median(
            x["tok_per_s"] / off_of[x["round"]]["tok_per_s"] for x in rows
        )
        row["router_cpu_vs_off"] = statistics.median(
            x["router_cpu_us_per_token"] / off_of[x["round"]]["router_cpu_us_per_token"]
            for x in rows
        )
        print(
            f"{mode:>5}: {row['tok_per_s']:.1f} tok/s ({row['throughput_vs_off']:.3f}x), "
            f"router {row['router_cpu_us_per_token']:.0f} us CPU/token ({row['router_cpu_vs_off']:.3f}x)"
        )
    print(f"OTLP exports received: {sink.num_exports}, {sink.num_bytes} bytes")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "args": vars(args) | {"json": str(args.json)},
                    "summary": summary,
                    "exports": {"count": sink.num_exports, "bytes": sink.num_bytes},
                    "runs": runs,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
