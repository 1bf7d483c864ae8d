"""Multi-turn chat on a worker whose KV pool (G1) holds at most a quarter of the working set:
KV tiers below the pool on against off (issue 21, benchmark 1).

Sessions re-send their whole history every turn (``baton bench --dataset multi-turn``). The
pool is sized from the workload (``kv_cache.num_blocks`` = a quarter of the blocks of every
session's final history, the shared system prompt once), so by the time a session's next
turn arrives the other sessions' turns have evicted its history from G1. Without tiers the
worker recomputes the history; with ``kv_cache.host_tier_gib`` (G2) and/or
``kv_cache.disk_tier_path`` (G3) the evicted blocks were written down and are onboarded
instead. The figures: TTFT of the turns after the first (goal: p50 at least 3x lower with
tiers) and output throughput (goal: not lower); and, since each repeat sends the same
sessions in every mode (greedy, EOS ignored), how many replies differ from the tiers-off
run's (each turn's reply digest): onboarded KV must change no token.

One aggregated worker (no hand-off: the pool that evicts is the one that prefills), served by
``python -m cluster`` in a subprocess and loaded by ``baton bench`` with ``--concurrency``
requests in flight (default 1: the pool never holds more than one request's history plus
what it keeps cached, and TTFT is prefill, not queueing). The modes alternate within every repeat, each repeat
with sessions of its own (seed + repeat); each figure is the median over repeats.

    python -m bench.kv_tiers --repeats 3 --json bench/kv_tiers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "host", "disk", "host+disk")
# A model whose prefill of a 1-2k-token history clearly costs more than the rest of a turn on
# a small CPU: the `small` llama's tokenizer and config with this shape (float32).
SHAPE = {
    "hidden_size": 384,
    "intermediate_size": 1152,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "dtype": "float32",
}
FIGURES = (  # (label, key path in a baton bench run)
    ("later TTFT p50 (ms)", ("multi_turn", "later_turns", "ttft_ms", "median")),
    ("later TTFT p90 (ms)", ("multi_turn", "later_turns", "ttft_ms", "p90")),
    ("first TTFT p50 (ms)", ("multi_turn", "first_turn", "ttft_ms", "median")),
    ("later cached share", ("multi_turn", "later_turns", "cached_share")),
    ("output tok/s", ("output_throughput",)),
    ("duration (s)", ("duration_s",)),
)


def bench_model(path: Path) -> Path:
    """Write the benchmark's model to ``path`` (once)."""
    if (path / "config.json").exists():
        return path
    from safetensors.torch import save_file

    from cluster.tools.make_model import _random_weights, make_model

    make_model(path, "llama", "small")
    config = json.loads((path / "config.json").read_text()) | SHAPE
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(_random_weights(config, 0, False), str(path / "model.safetensors"))
    return path


def block_bytes(block_size: int) -> int:
    """Bytes of one KV block of the model: K and V of every layer, float32."""
    per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    return per_token * 4 * block_size


def pool_blocks(args: argparse.Namespace, vocab_size: int) -> tuple[int, str]:
    """G1's size: a quarter of the workload's working set in blocks; and the arithmetic."""
    from cluster.loadgen.multiturn import multi_turn_workload

    w = multi_turn_workload(
        args.sessions, args.turns, args.system_len, args.user_len, args.output_len,
        0.0, args.think_time, vocab_size, args.seed,
    )  # fmt: skip
    tokens = w.working_set_tokens()
    # Each session's history in whole blocks (its last block is partial), the system prompt once.
    own = (tokens - args.system_len) // args.sessions
    blocks = args.system_len // args.block_size + args.sessions * -(-own // args.block_size)
    g1 = blocks // args.pool_fraction
    need = -(-w.longest_request() // args.block_size)
    if g1 < need * args.concurrency:
        raise ValueError(
            f"G1 of {g1} blocks cannot hold {args.concurrency} requests of {need} blocks"
        )
    text = (
        f"working set: system {args.system_len} + {args.sessions} sessions x "
        f"({args.turns} turns x {args.user_len} user + {args.turns - 1} replies x "
        f"{args.output_len}) = {tokens} tokens ~ {blocks} blocks of {args.block_size}; "
        f"G1 = {blocks} // {args.pool_fraction} = {g1} blocks "
        f"({g1 * block_bytes(args.block_size) / 2**20:.1f} MiB); the longest request needs "
        f"{need}; all of it in a tier: {blocks * block_bytes(args.block_size) / 2**20:.1f} MiB"
    )
    return g1, text


def tier_keys(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    keys: dict = {}
    if mode == "off" and supported("host"):
        keys["host_tier_gib"] = 0  # off, whatever the key's default becomes
    if "host" in mode:
        keys["host_tier_gib"] = args.host_tier_gib
    if "disk" in mode:
        keys["disk_tier_path"] = str(workdir / "disk")
        keys["disk_tier_gib"] = args.disk_tier_gib
    return keys


def supported(mode: str) -> bool:
    """Whether this tree's ``kv_cache`` section has the keys ``mode`` needs."""
    from cluster.config import KVCacheSection

    names = set(KVCacheSection.model_fields)
    needed = {"off": set(), "host": {"host_tier_gib"}, "disk": {"disk_tier_path"}}
    return all(needed[part] <= names for part in mode.split("+"))


def cluster_config(model_dir: Path, mode: str, g1: int, args, workdir: Path) -> dict:
    return {
        "model": {"path": str(model_dir), "name": "kv-tiers", "max_model_len": args.max_model_len},
        "prefill": {"replicas": 0},
        "decode": {"replicas": 1, "max_num_seqs": 8, "max_num_batched_tokens": 2048},
        "kv_cache": {"block_size": args.block_size, "num_blocks": g1, **tier_keys(mode, args, workdir)},
        "router": {"port": 0, "http_port": 0, "disaggregation": "never", "drain_grace_seconds": 5},
        "metrics": {"port": 0},
    }  # fmt: skip


def run_mode(mode: str, repeat: int, model_dir: Path, g1: int, args, host, workdir: Path) -> dict:
    """Serve ``mode``, run the sessions once with ``baton bench``; its run summary."""
    from bench.cluster_proc import ServedCluster

    host.wait_quiet(args.quiet_wait)
    cluster = ServedCluster(cluster_config(model_dir, mode, g1, args, workdir), workdir)
    try:
        result = workdir / "result.json"
        command = [
            str(Path(sys.executable).parent / "baton"), "bench", "--target", cluster.address,
            "--dataset", "multi-turn", "--num-sessions", str(args.sessions),
            "--num-turns", str(args.turns), "--system-prompt-len", str(args.system_len),
            "--input-len", str(args.user_len), "--output-len", str(args.output_len),
            "--think-time", str(args.think_time), "--max-concurrency", str(args.concurrency),
            "--ignore-eos",
            "--seed", str(args.seed + repeat), "--result-json", str(result),
        ]  # fmt: skip
        started = host.sample()
        subprocess.run(command, check=True, cwd=ROOT)
        foreign = host.foreign_s(started)
        run = json.loads(result.read_text())["runs"][0]
    finally:
        cluster.stop()
    if run["failed"]:
        raise RuntimeError(f"{mode}: {run['errors']}")
    # Per-request records are large: keep each reply's digest (in session, turn order) to
    # compare the modes token for token.
    run["reply_digests"] = [r["output_digest"] for r in run.pop("requests")]
    run["foreign_core_s"] = foreign
    return run


def figure(run: dict, path: tuple[str, ...]) -> float:
    value = run
    for key in path:
        value = value[key]
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="off,host", help=f"of {', '.join(MODES)} (off,host)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--think-time", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (1)")
    parser.add_argument("--pool-fraction", type=int, default=4, help="G1 = working set // this")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--host-tier-gib", type=float, default=0.5)
    parser.add_argument("--disk-tier-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=ROOT / ".models/bench-kv-tiers-llama")
    parser.add_argument("--quiet-wait", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if skipped := [m for m in modes if not supported(m)]:
        print(f"skipping {skipped}: this tree's kv_cache section has no tier keys yet")
        modes = [m for m in modes if m not in skipped]
    from bench.serving_cluster import Host

    model_dir = bench_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g1, arithmetic = pool_blocks(args, vocab)
    print(arithmetic, flush=True)
    host = Host()
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="baton-kv-tiers-") as tmp:
        for repeat in range(args.repeats):
            order = modes if repeat % 2 == 0 else modes[::-1]  # cancel drift
            for mode in order:
                workdir = Path(tmp) / f"{mode}-{repeat}"
                workdir.mkdir()
                run = run_mode(mode, repeat, model_dir, g1, args, host, workdir)
                runs[mode].append(run)
                print(f"repeat {repeat} {mode}: later TTFT p50 "
                      f"{figure(run, FIGURES[0][1]):.0f} ms", flush=True)  # fmt: skip
    medians = {
        mode: {label: median(figure(r, path) or 0.0 for r in rs) for label, path in FIGURES}
        for mode, rs in runs.items()
    }
    print(table(medians, modes))
    differing = {
        mode: [sum(a != b for a, b in zip(off["reply_digests"], other["reply_digests"], strict=True))
               for off, other in zip(runs["off"], rs, strict=True)]
        for mode, rs in runs.items() if mode != "off" and "off" in runs
    }  # fmt: skip
    for mode, counts in differing.items():
        total = len(runs[mode][0]["reply_digests"])
        print(f"{mode}: replies differing from off's, per repeat: {counts} of {total}")
    if args.json:
        document = {
            "command": " ".join(["python", "-m", "bench.kv_tiers", *sys.argv[1:]]),
            "machine": {"platform": platform.platform(), "processor": platform.processor()},
            "arithmetic": arithmetic,
            "arguments": {k: str(v) for k, v in vars(args).items()},
            "wall_s": time.monotonic() - started,
            "medians": medians,
            "replies_differing_from_off": differing,
            "runs": runs,
        }
        args.json.write_text(json.dumps(document, indent=1))
    return 0


def table(medians: dict, modes: list[str]) -> str:
    """Medians per mode, and each mode against ``off`` when it ran."""
    head = "| | " + " | ".join(modes) + " |"
    lines = [head, "|---" * (len(modes) + 1) + "|"]
    for label, _ in FIGURES:
        cells = " | ".join(f"{medians[m][label]:.3g}" for m in modes)
        lines.append(f"| {label} | {cells} |")
    if "off" in modes:
        for mode in (m for m in modes if m != "off"):
            off, on = medians["off"], medians[mode]
            ttft = off[FIGURES[0][0]] / on[FIGURES[0][0]]
            tput = on["output tok/s"] / off["output tok/s"]
            lines.append(f"\n{mode}: later-turn TTFT p50 {ttft:.2f}x lower, output {tput:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
