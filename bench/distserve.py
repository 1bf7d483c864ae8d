"""DistServe in miniature, measured with ``baton bench``: long prompts arrive among ongoing
decodes; 1 prefill + 1 decode worker (disaggregated) against 2 aggregated workers at the
same request rates.

The workload is a JSONL trace (written here, fixed seed) mixing two kinds of requests in
random order: *chat* (short prompt, long output: they spend their life decoding) and
*documents* (long prompt, short output). In the aggregated cluster a document's prefill
chunks share engine steps with the chats' decodes and stretch them; in the disaggregated
one the decode worker never prefills. Each configuration is served by ``python -m
cluster``'s entry point as a user would (bench/serving_cluster.py), and loaded by ``baton bench --dataset trace --rates ...``
(Poisson arrivals; each rate with fresh prompts, so no prefix-cache hits); the
configurations alternate in every repeat, and each figure is the median over repeats.

    python -m bench.distserve --rates 1.0,1.5,2.0,2.5,3.0 --repeats 3 \\
        --json bench/distserve.json --plot bench/distserve.png
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from bench.serving_cluster import Cluster, Host
from workers.parallel.replica import free_port

ROOT = Path(__file__).resolve().parents[1]

MODES = ("disaggregated", "aggregated")
FIGURES = (  # (key in a baton bench run, percentile key, label)
    ("ttft_ms", "median", "TTFT p50 (ms)"),
    ("ttft_ms", "p99", "TTFT p99 (ms)"),
    ("tpot_ms", "median", "TPOT p50 (ms)"),
    ("tpot_ms", "p99", "TPOT p99 (ms)"),
    ("itl_ms", "p99", "ITL p99 (ms)"),
    ("goodput", None, "goodput (req/s)"),
    ("request_throughput", None, "requests/s"),
    ("output_throughput", None, "output tok/s"),
    ("drain_s", None, "drain after last arrival (s)"),
)


def write_trace(path: Path, args: argparse.Namespace) -> dict:
    """The mixed workload; returns its composition."""
    rng = random.Random(args.seed)
    rows, kinds = [], {"chat": 0, "document": 0}
    for i in range(args.num_prompts):
        if rng.random() < args.document_share:
            kind, input_len, output_len = "document", rng.randint(800, 960), rng.randint(8, 32)
        else:
            kind, input_len, output_len = "chat", rng.randint(32, 96), rng.randint(64, 128)
        kinds[kind] += 1
        rows.append({"timestamp": i * 1000, "input_length": input_len, "output_length": output_len})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        **kinds,
        "input_tokens": sum(r["input_length"] for r in rows),
        "output_tokens": sum(r["output_length"] for r in rows),
    }


def cluster_config(model_dir: str, mode: str, args: argparse.Namespace) -> dict:
    pool = {"max_num_seqs": 64, "max_num_batched_tokens": args.max_num_batched_tokens}
    disaggregated = mode == "disaggregated"
    return {
        "model": {"path": model_dir, "name": "bench", "max_model_len": 1024},
        "prefill": {"replicas": 1 if disaggregated else 0, **pool},
        "decode": {"replicas": 1 if disaggregated else 2, **pool},
        "kv_cache": {"block_size": 16, "num_blocks": 2048},
        "kv_transfer": {"backend": "nixl"},
        "router": {
            "port": free_port("127.0.0.1"),  # serving_cluster.Cluster needs it up front
            "http_port": 0,  # gRPC only
            "policy": "kv_aware",
            "disaggregation": "always" if disaggregated else "never",
            "max_queued_requests": 4 * args.num_prompts,
            "drain_grace_seconds": 5,
        },
        "metrics": {"port": 0},
    }


def run_mode(mode: str, model_dir: str, trace: Path, args, host: Host, workdir: Path) -> list:
    """Serve ``mode``, sweep the rates with ``baton bench``; its runs (one per rate)."""
    host.wait_quiet(args.quiet_wait)
    cluster = Cluster(cluster_config(model_dir, mode, args), workdir)
    try:
        result = workdir / "result.json"
        command = [
            str(Path(sys.executable).parent / "baton"), "bench", "--target", cluster.address,
            "--dataset", "trace", "--trace", str(trace), "--rates", args.rates,
            "--ignore-eos", "--warmup", "4", "--seed", str(args.seed), "--slo", args.slo,
            "--result-json", str(result),
        ]  # fmt: skip
        started = host.sample()
        subprocess.run(command, check=True, cwd=ROOT)
        foreign = host.foreign_s(started)
        runs = json.loads(result.read_text())["runs"]
    finally:
        cluster.stop()
    for run in runs:
        if run["failed"]:
            raise RuntimeError(f"{mode} at {run['request_rate']}: {run['errors']}")
        records = run.pop("requests")  # per-request records: large; kept as two figures
        run.update(drain_s=drain_s(records, run["duration_s"]), foreign_core_s=foreign)
    return runs


def drain_s(records: list[dict], duration_s: float) -> float:
    """How long the server took to finish after the last request was sent. One that keeps
    up with its arrivals ends about one request's latency after the last one; one that
    falls behind has a queue left, and this grows with the rate and the run's length."""
    return duration_s - max(r["send_s"] for r in records)


def figure(run: dict, key: str, pct: str | None) -> float:
    return run[key][pct] if pct else run[key]


def summarize(all_runs: dict[str, list[list[dict]]], rates: list[float]) -> dict:
    """Median over repeats of every figure, per mode and rate."""
    out: dict = {}
    for mode, repeats in all_runs.items():
        out[mode] = {}
        for i, rate in enumerate(rates):
            out[mode][str(rate)] = {
                label: median(figure(runs[i], key, pct) for runs in repeats)
                for key, pct, label in FIGURES
            }
    return out


def table(medians: dict, rates: list[float]) -> str:
    lines = []
    for rate in rates:
        d, a = medians["disaggregated"][str(rate)], medians["aggregated"][str(rate)]
        lines += [f"\n**{rate} req/s**\n", "| | disaggregated 1P+1D | aggregated 2× | A ÷ D |"]
        lines.append("|---|---|---|---|")
        for _, _, label in FIGURES:
            ratio = a[label] / d[label] if d[label] else float("nan")
            lines.append(f"| {label} | {d[label]:.3g} | {a[label]:.3g} | {ratio:.2f}× |")
    return "\n".join(lines)


def verdict(medians: dict, rates: list[float], slack: float) -> dict:
    """The rates each configuration sustains, and the TPOT p99 ratio at the highest rate
    both sustain. The lowest rate is the baseline where no queue forms: a configuration
    sustains a rate when its drain there is at most ``slack`` times its baseline drain (the
    last request is the same trace row at every rate, so the drains are comparable)."""
    label = "drain after last arrival (s)"
    kept: dict[str, list[float]] = {}
    for mode, by in medians.items():
        kept[mode] = []
        for rate in rates:  # up to the first rate it does not sustain
            if by[str(rate)][label] > slack * by[str(rates[0])][label]:
                break
            kept[mode].append(rate)
    both = [r for r in rates if all(r in k for k in kept.values())]
    out: dict = {"sustained": kept, "highest_both_sustain": max(both) if both else None}
    if both:
        d, a = (medians[m][str(max(both))]["TPOT p99 (ms)"] for m in MODES)
        out["tpot_p99_aggregated_over_disaggregated"] = a / d
    return out


def plot(medians: dict, rates: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["TTFT p99 (ms)", "TPOT p99 (ms)", "TPOT p50 (ms)", "goodput (req/s)"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, label in zip(axes.flat, labels, strict=True):
        for mode, style in zip(MODES, ("o-", "s--"), strict=True):
            ax.plot(rates, [medians[mode][str(r)][label] for r in rates], style, label=mode)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("1 prefill + 1 decode vs 2 aggregated workers: documents among chats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1.0,1.5,2.0,2.5,3.0")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--document-share", type=float, default=0.4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slo", default="ttft=4000,tpot=100")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model directory (default: a small random Llama)")
    parser.add_argument("--quiet-wait", type=float, default=30.0)
    parser.add_argument(
        "--drain-slack",
        type=float,
        default=2.0,
        help="sustained: drain <= this x the lowest rate's",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    model_dir = Path(args.model) if args.model else ROOT / ".models/bench-small-llama"
    if not (model_dir / "config.json").exists():
        from cluster.tools.make_model import make_model

        make_model(model_dir, "llama", "small", seed=0)
    host = Host()
    all_runs: dict[str, list] = {mode: [] for mode in MODES}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="baton-distserve-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        workload = write_trace(trace, args)
        print(f"workload: {workload}", flush=True)
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]  # cancel drift
            for mode in order:
                workdir = Path(tmp) / f"{mode}-{repeat}"
                workdir.mkdir()
                runs = run_mode(mode, str(model_dir), trace, args, host, workdir)
                all_runs[mode].append(runs)
                print(f"repeat {repeat} {mode}: done", flush=True)
    medians = summarize(all_runs, rates)
    print(table(medians, rates))
    decided = verdict(medians, rates, args.drain_slack)
    print(f"\n{decided}")
    if args.plot:
        plot(medians, rates, args.plot)
    if args.json:
        document = {
            "command": " ".join(["python", "-m", __spec__.name, *sys.argv[1:]]),
            "machine": {"platform": platform.platform(), "processor": platform.processor()},
            "workload": workload,
            "arguments": {k: str(v) for k, v in vars(args).items()},
            "wall_s": time.monotonic() - started,
            "medians": medians,
            "verdict": decided,
            "runs": all_runs,
        }
        args.json.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
