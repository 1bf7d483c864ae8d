"""Peer pull (G4) against recompute (issue 21, benchmark 3): the TTFT of a prompt whose
prefix worker A computed, requested on worker B, in one served cluster.

Two decode workers that prefill themselves (``disaggregation: never``, ``round_robin``:
requests alternate A, B), ``kv_cache.peer_sharing: true``, NIXL. Each repeat runs both
cases, in alternating order:

- **peer**: A computes prefix P (a warm request); then P + a tail goes to B, which pulls
  P's blocks from A (router/peer_prefix.py) and computes the tail;
- **recompute**: A serves a short unrelated prompt (keeps the alternation); then Q + a
  tail, whose prefix no worker holds, goes to B, which computes all of it.

Both measured requests have the same length and one output token; TTFT is the client's
(gRPC, request sent to first token). ``cached_prompt_tokens`` of each says what B did
not compute. The machine is shared: the other processes' CPU use is recorded per repeat.

    python -m bench.kv_peer --prefix-tokens 1024 --repeats 5 --json bench/kv_peer.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path
from statistics import median

import grpc

from bench.cluster_proc import ServedCluster
from bench.serving_cluster import Host
from cluster.client import stream_generate
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

BLOCK_SIZE = 16


def cluster_config(model_dir: Path, args: argparse.Namespace) -> dict:
    return {
        "model": {"path": str(model_dir), "name": "bench", "max_model_len": 4096},
        "prefill": {"replicas": 0},
        "decode": {"replicas": 2, "max_num_seqs": 8, "max_num_batched_tokens": 512},
        "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": 1024, "peer_sharing": True},
        "kv_transfer": {"backend": "nixl"},
        "router": {
            "port": 0,
            "policy": "round_robin",
            "disaggregation": "never",
            "drain_grace_seconds": 5,
        },
        "metrics": {"port": 0},
    }


def ask(stub, prompt: list[int]) -> tuple[float, int, str]:
    """(TTFT seconds, cached prompt tokens, decode worker) of one greedy 1-token request."""
    start = time.perf_counter()
    ttft = None
    final = None
    for msg in stream_generate(
        stub, prompt, max_tokens=1, temperature=0.0, ignore_eos=True, return_timing=True
    ):
        if ttft is None:
            ttft = time.perf_counter() - start
        if msg.WhichOneof("kind") == "final":
            final = msg.final
    assert final is not None and ttft is not None
    return ttft, final.usage.cached_prompt_tokens, final.timing.decode_worker


def one_case(stub, case: str, rng: random.Random, args) -> dict:
    """A warm request on A, then the measured one on B."""
    vocab = args.vocab
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix_tokens)]
    tail = [rng.randrange(3, vocab) for _ in range(args.tail_tokens)]
    if case == "peer":
        warm = [*prefix, rng.randrange(3, vocab)]
    else:  # A computes something else; B's prefix is nowhere
        warm = [rng.randrange(3, vocab) for _ in range(BLOCK_SIZE)]
    _, _, worker_a = ask(stub, warm)
    time.sleep(args.report_wait)  # A's report (with its hashes) reaches the router
    ttft, cached, worker_b = ask(stub, prefix + tail)
    assert worker_a == "decode-0" and worker_b == "decode-1", (worker_a, worker_b)
    return {"case": case, "ttft_ms": 1000 * ttft, "cached_prompt_tokens": cached}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: make small)")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--tail-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--report-wait", type=float, default=0.5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kv_peer"))
    model_dir = args.model
    if model_dir is None:
        from cluster.tools.make_model import make_model

        model_dir = make_model(workdir / "small", "llama", "small", dtype="float32")
    args.vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    host = Host()
    served = ServedCluster(cluster_config(Path(model_dir), args), workdir)
    rows = []
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(served.address))
        rng = random.Random(21)
        one_case(stub, "recompute", rng, args)  # warm-up: first-request costs on both
        for i in range(args.repeats):
            order = ("peer", "recompute") if i % 2 == 0 else ("recompute", "peer")
            for case in order:
                start, began = host.sample(), time.monotonic()
                row = one_case(stub, case, rng, args)
                row["repeat"] = i
                # Other processes' CPU use while the case ran (warm request included).
                row["foreign_cores"] = host.foreign_s(start) / (time.monotonic() - began)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        served.stop()
    summary = {}
    for case in ("peer", "recompute"):
        mine = [r for r in rows if r["case"] == case]
        summary[case] = {
            "ttft_ms_median": median(r["ttft_ms"] for r in mine),
            "ttft_ms": [round(r["ttft_ms"], 1) for r in mine],
            "cached_prompt_tokens": sorted({r["cached_prompt_tokens"] for r in mine}),
        }
    ratio = summary["recompute"]["ttft_ms_median"] / summary["peer"]["ttft_ms_median"]
    result = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "prefix_tokens": args.prefix_tokens,
        "tail_tokens": args.tail_tokens,
        "repeats": args.repeats,
        "summary": summary,
        "recompute_over_peer": ratio,
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
