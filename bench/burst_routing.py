"""Routing under bursts (issue 27), measured with ``baton bench``: the routing before the
router counted the requests it routed (a tree of an older commit, ``--old-tree``) against
this tree's, on the same cluster config, workload and seed, alternating in every repeat.

Each variant serves ``python -m cluster CONFIG`` from its tree (``PYTHONPATH`` and working
directory: its router and workers), with a Ray instance of its own; ``baton bench`` of
this tree loads it (its records name the decode worker of each request; the older router
returns that too). Figures per run: requests per decode worker (max / min), TTFT p99,
TPOT p99; the table has the medians over repeats.

    git -C /work/main worktree add /tmp/i27-old 96d4209
    python -m bench.burst_routing --old-tree /tmp/i27-old --decode 2 --prefill 1 \\
        --repeats 3 --json bench/burst_routing.json

A variant is ``old``, ``new``, or ``new:KEY=VALUE,...`` (router settings of this tree, e.g.
``new:kv_overlap_weight=2``) to compare ``kv_aware``'s constants.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

import yaml

from bench.cluster_proc import ServedCluster
from bench.serving_cluster import Host

ROOT = Path(__file__).resolve().parents[1]


def parse_variant(text: str, old_tree: Path | None) -> tuple[Path, dict]:
    """``old`` | ``new`` | ``new:KEY=VALUE,...`` -> (tree, router overrides)."""
    name, _, rest = text.partition(":")
    if name == "old":
        if old_tree is None:
            raise SystemExit("--old-tree: needed for the variant old")
        return old_tree, {}
    if name != "new":
        raise SystemExit(f"--variants: {text!r} is not old, new or new:KEY=VALUE,...")
    overrides = {}
    for pair in filter(None, rest.split(",")):
        key, _, value = pair.partition("=")
        overrides[key] = yaml.safe_load(value)
    return ROOT, overrides


def cluster_config(model_dir: Path, args: argparse.Namespace, overrides: dict) -> dict:
    pool = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
    return {
        "model": {"path": str(model_dir), "name": "bench", "max_model_len": 1024},
        "prefill": {"replicas": args.prefill, **pool},
        "decode": {"replicas": args.decode, **pool},
        "kv_cache": {"block_size": 16, "num_blocks": 1024},
        "kv_transfer": {"backend": "nixl"},
        "router": {
            "port": 0,
            "policy": args.policy,
            "disaggregation": args.disaggregation,
            "max_queued_requests": 4 * args.num_prompts,
            "drain_grace_seconds": 5,
            **overrides,
        },
        "metrics": {"port": 0},
    }


def run_variant(variant: str, model_dir: Path, args, host: Host, workdir: Path) -> dict:
    """Serve one variant, load it once; its figures."""
    tree, overrides = parse_variant(variant, args.old_tree)
    host.wait_quiet(args.quiet_wait)
    served = ServedCluster(cluster_config(model_dir, args, overrides), workdir, tree=tree)
    try:
        result = workdir / "result.json"
        command = [
            str(Path(sys.executable).parent / "baton"), "bench", "--target", served.address,
            "--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--range-ratio", "0.25", "--request-rate", str(args.request_rate),
            "--burstiness", str(args.burstiness), "--ignore-eos", "--warmup", "2",
            "--seed", str(args.seed), "--result-json", str(result),
        ]  # fmt: skip
        if args.dataset == "shared-prefix":
            command += ["--prefix-len", str(args.prefix_len), "--num-groups", "4"]
        started = host.sample()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's baton bench
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        foreign = host.foreign_s(started)
        (run,) = json.loads(result.read_text())["runs"]
    finally:
        served.stop()
    if run["failed"]:
        raise RuntimeError(f"{variant}: {run['errors']}")
    per_worker = Counter(r["decode_worker"] for r in run["requests"])
    counts = [per_worker.get(f"decode-{i}", 0) for i in range(args.decode)]
    return {
        "requests_per_decode_worker": counts,
        "max_over_min": max(counts) / min(counts) if min(counts) else float("inf"),
        "ttft_p99_ms": run["ttft_ms"]["p99"],
        "tpot_p99_ms": run["tpot_ms"]["p99"],
        "tpot_median_ms": run["tpot_ms"]["median"],
        "output_throughput": run["output_throughput"],
        "cached_prompt_tokens": run["cached_prompt_tokens"],
        "foreign_core_s": foreign,
    }


FIGURES = (
    "max_over_min",
    "ttft_p99_ms",
    "tpot_p99_ms",
    "tpot_median_ms",
    "output_throughput",
    "cached_prompt_tokens",
)


def table(runs: dict[str, list[dict]]) -> str:
    lines = [
        "| variant | requests per decode worker (each run) | max/min | TTFT p99 (ms) "
        "| TPOT p99 (ms) | TPOT p50 (ms) | output tok/s | cached prompt tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, repeats in runs.items():
        spread = "; ".join("/".join(map(str, r["requests_per_decode_worker"])) for r in repeats)
        m = {f: median(r[f] for r in repeats) for f in FIGURES}
        lines.append(
            f"| {variant} | {spread} | {m['max_over_min']:.2f} | {m['ttft_p99_ms']:.0f} "
            f"| {m['tpot_p99_ms']:.1f} | {m['tpot_median_ms']:.1f} "
            f"| {m['output_throughput']:.1f} | {m['cached_prompt_tokens']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, help="a worktree of the commit to compare")
    parser.add_argument("--variants", default="old;new", help="separated by ';' (old;new)")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--policy", default="kv_aware")
    parser.add_argument("--disaggregation", default="always")
    parser.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix only")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--burstiness", type=float, default=0.2, help="gamma shape; < 1 bursty")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="model directory (default: small Llama)")
    parser.add_argument("--quiet-wait", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    variants = args.variants.split(";")
    model_dir = args.model or ROOT / ".models/bench-small-llama"
    if not (model_dir / "config.json").exists():
        from cluster.tools.make_model import make_model

        make_model(model_dir, "llama", "small", seed=0)
    host = Host()
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="baton-burst-") as tmp:
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else variants[::-1]  # cancel drift
            for variant in order:
                workdir = Path(tmp) / f"{len(runs[variant])}-{repeat}-{variant.replace(':', '_')}"
                workdir.mkdir()
                figures = run_variant(variant, model_dir, args, host, workdir)
                runs[variant].append(figures)
                print(f"repeat {repeat} {variant}: {figures}", flush=True)
    print(table(runs))
    if args.json:
        document = {
            "command": " ".join(["python", "-m", __spec__.name, *sys.argv[1:]]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "arguments": {k: str(v) for k, v in vars(args).items()},
            "wall_s": time.monotonic() - started,
            "runs": runs,
        }
        args.json.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
