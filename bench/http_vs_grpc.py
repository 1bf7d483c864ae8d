"""The HTTP front end's cost per streamed token against gRPC's, on one cluster and workload.

One cluster serves both front ends (``router.http_port`` set); ``baton bench`` drives the
same workload through each, alternating (grpc, openai, grpc, ...) so that the machine's
noise falls on both alike: ``--num-prompts`` requests of ``--input-len`` random token ids
each, ``--output-len`` tokens each (EOS ignored), at most ``--concurrency`` streams in
flight. Every run draws its own prompts (seed = the run's number), so that none is served
from a prefix cache an earlier run filled. The figure: output tokens/s, median over the
repeats of each backend, and its ratio HTTP / gRPC; TTFT and ITL medians beside it.

    python -m bench.http_vs_grpc --repeats 5 --json bench/http_vs_grpc.json

The client runs on the same machine as the cluster (both backends'), so its cost is in the
figure too: an SSE chunk is parsed as JSON by aiohttp's client, a gRPC message by grpcio's.
The front end's own cost is measured apart: the CPU time of the serving process (the
router, both front ends; the workers are Ray's processes) per output token.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import yaml

from bench.serving_cluster import Host

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """``python -m cluster CONFIG`` in a subprocess with a Ray instance of its own."""

    def __init__(self, config: dict, workdir: Path):
        path = workdir / "cluster.yaml"
        path.write_text(yaml.safe_dump(config))
        env = {**os.environ, "RAY_ADDRESS": "local"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cluster", str(path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.address = ""
        ready = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("baton: serving"):
                    self.address = line.split(" on ", 1)[1].split(" ", 1)[0]
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 240
        while not ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("cluster did not start:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)


def cluster_config(model_dir: str, http_port: int, args: argparse.Namespace) -> dict:
    pool = {"max_num_seqs": 64, "max_num_batched_tokens": 2048}
    return {
        "model": {"path": model_dir, "name": "bench", "max_model_len": 1024},
        "prefill": {"replicas": 1, **pool},
        "decode": {"replicas": 1, **pool},
        "kv_cache": {"block_size": 16, "num_blocks": 4096},
        "kv_transfer": {"backend": "nixl"},
        "router": {
            "port": 0,
            "http_port": http_port,
            "disaggregation": args.disaggregation,
            "max_queued_requests": 4 * args.num_prompts,
        },
        "metrics": {"enabled": False},
    }


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_once(backend: str, served: Served, http_url: str, seed: int, args, out: Path) -> dict:
    where = ["--target", served.address]
    if backend == "openai":
        where = ["--backend", "openai", "--base-url", http_url]
    command = [
        str(Path(sys.executable).parent / "baton"), "bench", *where,
        "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--seed", str(seed), "--result-json", str(out),
    ]  # fmt: skip
    router_cpu = cpu_s(served.process.pid)
    client_cpu = _children_cpu_s()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    router_cpu = cpu_s(served.process.pid) - router_cpu
    client_cpu = _children_cpu_s() - client_cpu
    [run] = json.loads(out.read_text())["runs"]
    if run["failed"]:
        raise RuntimeError(f"{backend}: {run['errors']}")
    return {
        "output_throughput": run["output_throughput"],
        "ttft_median_ms": run["ttft_ms"]["median"],
        "itl_median_ms": run["itl_ms"]["median"],
        "tpot_median_ms": run["tpot_ms"]["median"],
        "duration_s": run["duration_s"],
        "router_cpu_us_per_token": 1e6 * router_cpu / run["total_output_tokens"],
        "client_cpu_us_per_token": 1e6 * client_cpu / run["total_output_tokens"],
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (the baton bench clients)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny Llama, made here)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per backend (5)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--disaggregation", choices=("always", "never"), default="always")
    parser.add_argument("--quiet-wait", type=float, default=20.0, help="wait for a quiet host")
    parser.add_argument("--json", type=Path, help="write every run and the medians")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="http-vs-grpc-"))
    model_dir = args.model
    if model_dir is None:
        from cluster.tools.make_model import make_model

        model_dir = str(make_model(workdir / "tiny", "llama", "tiny"))
    http_port = free_port()
    host = Host()
    served = Served(cluster_config(model_dir, http_port, args), workdir)
    runs: dict[str, list[dict]] = {"grpc": [], "openai": []}
    try:
        http_url = f"http://127.0.0.1:{http_port}"
        bench_once("grpc", served, http_url, 10_000, args, workdir / "warm.json")  # warm-up
        for repeat in range(args.repeats):
            for index, backend in enumerate(("grpc", "openai")):
                host.wait_quiet(args.quiet_wait)
                started = host.sample()
                seed = 2 * repeat + index
                run = bench_once(backend, served, http_url, seed, args, workdir / "run.json")
                run["foreign_core_s"] = host.foreign_s(started)
                runs[backend].append(run)
                print(
                    f"{backend:>6} #{repeat}: {run['output_throughput']:.1f} tok/s, "
                    f"TTFT {run['ttft_median_ms']:.1f} ms, ITL {run['itl_median_ms']:.2f} ms, "
                    f"router {run['router_cpu_us_per_token']:.0f} CPU-us/token, "
                    f"client {run['client_cpu_us_per_token']:.0f} CPU-us/token, "
                    f"others used {run['foreign_core_s']:.1f} core-s",
                    flush=True,
                )
    finally:
        served.stop()
    medians = {
        backend: {key: median(r[key] for r in rs) for key in rs[0]} for backend, rs in runs.items()
    }
    ratio = medians["openai"]["output_throughput"] / medians["grpc"]["output_throughput"]
    for backend, m in medians.items():
        print(
            f"median {backend:>6}: {m['output_throughput']:.1f} tok/s, TTFT "
            f"{m['ttft_median_ms']:.1f} ms, ITL {m['itl_median_ms']:.2f} ms, router "
            f"{m['router_cpu_us_per_token']:.0f} CPU-us/token, client "
            f"{m['client_cpu_us_per_token']:.0f} CPU-us/token"
        )
    print(f"HTTP / gRPC output tokens/s: {ratio:.3f}")
    if args.json:
        document = {"arguments": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
        document.update(medians=medians, ratio=ratio)
        args.json.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
