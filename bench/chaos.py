"""Chaos campaign (issue 25): a real 2 prefill + 2 decode cluster under steady load while
worker processes are SIGKILLed, KV transfers fail, and hostile requests arrive.

    python -m bench.chaos --minutes 20 --json bench/chaos.json
    python -m bench.chaos --minutes 1   # smoke run

The cluster is ``python -m cluster`` in a subprocess (``bench/cluster_proc.py``) with
its own Ray instance and the transfer fault injector on (``BATON_KV_FAULTS``,
kvtransfer/faults.py). Before it starts, the ``LLM`` API computes the reference output
of every prompt of the workload (greedy and seeded sampling) on the same weights. Then,
for ``--minutes``:

- steady load (``bench/chaos_traffic.py``): client threads over gRPC and HTTP, every
  request classified as equal to the reference, WRONG, or an error by its code;
- every ``--kill-every`` seconds a random worker process (a ``ray::WorkerActor``) gets
  SIGKILL, once every worker is serving again; the router restarts it (and, where the
  router migrates requests, resends its requests elsewhere);
- every ``--hostile-every`` seconds the hostile mix (malformed fields, huge strings,
  invalid UTF-8, out-of-range token ids, random bytes, a client leaving mid-stream);
- every ``--overload-every`` seconds a burst past ``router.max_queued_requests``: the
  time each refusal took.

At the end, once the load has stopped: every worker must report 0 KV blocks in use
(prefix-cache blocks count as free) within the lease time, the cluster must still answer
every prompt with the reference, and the serving process must still run. The figures go
to ``--json`` and a summary is printed; the exit status is 1 if a goal was missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from bench.chaos_traffic import (
    SteadyLoad,
    build_workload,
    grpc_case,
    hostile_round,
    http_case,
    overload_probe,
)
from bench.cluster_proc import ROOT, ServedCluster, free_port, processes
from cluster.client import get_status
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

WORKER_PROCESS = "ray::WorkerActor"
DEFAULT_FAULTS = "fail_every=7,delay_ms=30,delay_every=5,drop_notify_every=11"
LEASE_S, TRANSFER_TIMEOUT_S = 10.0, 4.0
MAX_QUEUED = 48
# The codes a request may end with (docs/reliability.md); anything else is a finding.
DOCUMENTED = {
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "INTERNAL",
    "DEADLINE_EXCEEDED",
}


def cluster_config(model_dir: Path, args: argparse.Namespace) -> dict:
    pool = {"max_num_seqs": 16, "max_num_batched_tokens": 512}
    return {
        "model": {"path": str(model_dir), "name": "chaos", "max_model_len": 512},
        "prefill": {"replicas": args.prefill, **pool},
        "decode": {"replicas": args.decode, **pool},
        "kv_cache": {"block_size": 16, "num_blocks": 512},
        "kv_transfer": {
            "backend": "nixl",
            "lease_seconds": LEASE_S,
            "timeout_seconds": TRANSFER_TIMEOUT_S,
            "on_failure": "recompute",
            "direction": args.direction,
        },
        "router": {
            "port": 0,
            "http_port": free_port(),
            "disaggregation": "always",  # every request hands its KV over
            "max_queued_requests": MAX_QUEUED,
            "drain_grace_seconds": 5,
            "restart_backoff_seconds": 1,
        },
        "metrics": {"port": 0},
    }


# ---- the cluster's state -------------------------------------------------------------------
def workers(stub) -> list:
    try:
        status = get_status(stub, timeout_s=10)
    except grpc.RpcError:
        return []
    return [w for pool in status.pools for w in pool.workers]


def all_serving(stub, expected: int) -> bool:
    ws = workers(stub)
    return len(ws) == expected and all(w.state == "serving" and w.healthy for w in ws)


def wait_for(predicate, timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def scrape(urls: list[str]) -> dict[str, float]:
    """Sum of every sample per ``name{labels}`` over the metrics endpoints."""
    totals: Counter = Counter()
    for url in urls:
        try:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\deE.naNInf]+)$", line)
            if m:
                totals[m.group(1) + (m.group(2) or "")] += float(m.group(3))
    return dict(totals)


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> dict[str, float] | float:
    """Total of ``name``'s samples with ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def by_label(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: Counter = Counter()
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        m = re.search(rf'{label}="([^"]*)"', rest)
        if base == name and m:
            out[m.group(1)] += value
    return dict(out)


# ---- the campaign --------------------------------------------------------------------------
class Campaign:
    def __init__(self, cluster: ServedCluster, cases, args, vocab_size: int):
        self.cluster = cluster
        self.cases = cases
        self.args = args
        self.vocab_size = vocab_size
        self.num_workers = args.prefill + args.decode
        self.channel = grpc.insecure_channel(cluster.address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.rng = random.Random(args.seed)
        self.kills: list[dict] = []
        self.hostile: Counter = Counter()
        self.refusal_s: list[float] = []  # burst calls refused (client-side start to end)
        self.probe_s: list[float] = []  # single calls sent while the queue was full
        self.overload_admitted: list[int] = []
        self.min_healthy: dict[str, int] = {}

    def kill_one(self) -> None:
        pids = processes(self.cluster.process.pid, WORKER_PROCESS)
        if not pids:
            return
        before = {w.name: w.restarts for w in workers(self.stub)}
        pid = self.rng.choice(pids)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        name = ""

        def seen_dead() -> bool:
            nonlocal name
            for w in workers(self.stub):
                if w.state != "serving" or w.restarts > before.get(w.name, 0):
                    name = w.name
                    return True
            return False

        wait_for(seen_dead, 20, 0.1)
        back = wait_for(lambda: all_serving(self.stub, self.num_workers), 180, 0.5)
        self.kills.append(
            {
                "t": round(start - self.t0, 1),
                "pid": pid,
                "worker": name,
                "serving_again_s": round(time.monotonic() - start, 1) if back else None,
            }
        )
        print(
            f"  [{start - self.t0:6.0f}s] SIGKILL pid {pid} ({name or '?'}); "
            f"back in {self.kills[-1]['serving_again_s']} s",
            flush=True,
        )

    def run(self, load: SteadyLoad) -> None:
        args = self.args
        self.t0 = time.monotonic()
        end = self.t0 + args.minutes * 60
        next_kill = self.t0 + args.kill_every / 2
        next_hostile = self.t0 + 5
        next_overload = self.t0 + args.overload_every / 2
        next_print = self.t0 + 30
        while time.monotonic() < end:
            now = time.monotonic()
            if self.cluster.process.poll() is not None:
                print("  the serving process exited!", flush=True)
                return
            if args.kill_every and now >= next_kill:
                self.kill_one()  # returns once every worker serves again
                next_kill = time.monotonic() + args.kill_every
            elif args.hostile_every and now >= next_hostile:
                self.hostile += hostile_round(
                    self.channel, self.cluster.http_url, self.vocab_size, self.rng
                )
                next_hostile = time.monotonic() + args.hostile_every
            elif args.overload_every and now >= next_overload:
                refused, probes, admitted = overload_probe(self.channel, MAX_QUEUED + 40)
                self.refusal_s += refused
                self.probe_s += probes
                self.overload_admitted.append(admitted)
                next_overload = time.monotonic() + args.overload_every
            else:
                time.sleep(0.5)
            if now >= next_print:
                print(f"  [{now - self.t0:6.0f}s] {load.outcomes.by_outcome()}", flush=True)
                next_print = now + 60

    def settle(self) -> dict:
        """After the load: idle, every worker serving, and no KV block in use."""
        idle = wait_for(
            lambda: (
                all_serving(self.stub, self.num_workers)
                and all(w.num_running == 0 and w.num_waiting == 0 for w in workers(self.stub))
            ),
            240,
        )
        start = time.monotonic()
        freed = wait_for(
            lambda: all(w.kv_blocks_used == 0 for w in workers(self.stub)),
            LEASE_S + TRANSFER_TIMEOUT_S + 30,
        )
        return {
            "idle": idle,
            "blocks_free_after_s": round(time.monotonic() - start, 1),
            "all_free": freed,
            "kv_blocks_used": {w.name: w.kv_blocks_used for w in workers(self.stub)},
            "kv_blocks_cached": {w.name: w.kv_blocks_cached for w in workers(self.stub)},
            "restarts": {w.name: w.restarts for w in workers(self.stub)},
            "states": {w.name: w.state for w in workers(self.stub)},
        }

    def still_serves(self) -> dict:
        """Every case once over gRPC and a few over HTTP, after the chaos."""
        out: Counter = Counter()
        for case in self.cases:
            out["grpc:" + grpc_case(self.stub, case)[0]] += 1
        for case in self.cases[:6]:
            if self.cluster.http_url:
                out["http:" + http_case(self.cluster.http_url, case)[0]] += 1
        return dict(out)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} (shared with other sessions)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=6, help="steady-load clients")
    parser.add_argument("--http-share", type=float, default=0.3)
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds; 0 = never")
    parser.add_argument("--hostile-every", type=float, default=20.0, help="seconds; 0 = never")
    parser.add_argument("--overload-every", type=float, default=180.0, help="seconds; 0 = never")
    parser.add_argument("--faults", default=DEFAULT_FAULTS, help="BATON_KV_FAULTS ('' = none)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument(
        "--direction",
        default="auto",
        choices=("auto", "pull", "push"),
        help="kv_transfer.direction",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny llama)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--cluster-log", type=Path, help="write the cluster's output here")
    args = parser.parse_args()

    model_dir = args.model or ROOT / ".models/chaos-tiny-llama"
    if not (model_dir / "config.json").exists():
        from cluster.tools.make_model import make_model

        make_model(model_dir, "llama", "tiny", seed=0)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"references of {args.num_prompts} prompts (LLM API, same weights)...", flush=True)
    cases = build_workload(str(model_dir), args.num_prompts, vocab_size, args.seed)

    with tempfile.TemporaryDirectory(prefix="baton-chaos-") as tmp:
        env = {"BATON_KV_FAULTS": args.faults} if args.faults else {}
        cluster = ServedCluster(cluster_config(model_dir, args), Path(tmp), env=env)
        campaign = Campaign(cluster, cases, args, vocab_size)
        try:
            wait_for(lambda: all_serving(campaign.stub, campaign.num_workers), 120)
            print(
                f"serving on {cluster.address} and {cluster.http_url}; "
                f"faults {args.faults!r}; {args.minutes} min",
                flush=True,
            )
            load = SteadyLoad(
                cluster.address,
                cluster.http_url,
                cases,
                args.concurrency,
                args.http_share,
                args.seed,
            )
            campaign.run(load)
            load.stop()
            print("load stopped; waiting for the cluster to settle...", flush=True)
            survived = cluster.process.poll() is None
            settled = campaign.settle() if survived else {}
            after = campaign.still_serves() if survived else {}
            samples = scrape(cluster.metrics_urls)
        finally:
            campaign.channel.close()
            rc = cluster.stop() if cluster.process.poll() is None else cluster.process.returncode
    if args.cluster_log:
        args.cluster_log.write_text("\n".join(cluster.lines) + "\n")
    report = summarize(args, campaign, load, settled, after, samples, survived, rc, cluster)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    print(figures_table(report))
    goals = report["goals"]
    return 0 if all(goals.values()) else 1


def summarize(args, campaign, load, settled, after, samples, survived, rc, cluster) -> dict:
    outcomes = load.outcomes.by_outcome()
    restarts = sum(settled.get("restarts", {}).values())
    leaked = sum(settled.get("kv_blocks_used", {}).values()) if settled else None
    tracebacks = sum("Traceback" in line for line in cluster.lines)
    hostile_outcomes = Counter()
    for (frontend, _name, outcome), n in campaign.hostile.items():
        hostile_outcomes[f"{frontend}:{outcome}"] += n
    crashes = {
        "serving_process_died": not survived,
        "unexpected_worker_restarts": max(0, restarts - len(campaign.kills)),
        "workers_not_serving_at_end": sum(
            s != "serving" for s in settled.get("states", {}).values()
        ),
    }
    refusal_p99 = percentile(campaign.probe_s, 0.99)
    report = {
        "command": "python -m bench.chaos " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "minutes": args.minutes,
        "cluster": f"{args.prefill} prefill + {args.decode} decode, tiny llama, CPU, NIXL "
        f"(direction {args.direction})",
        "faults_env": args.faults,
        "requests": {
            "sent": sum(outcomes.values()),
            "completed_equal": outcomes.get("equal", 0),
            "completed_wrong": outcomes.get("WRONG", 0),
            "errors": {
                k.removeprefix("error:"): v for k, v in outcomes.items() if k.startswith("error:")
            },
            "by_frontend": {f"{f}:{o}": n for (f, o), n in sorted(load.outcomes.counts.items())},
            "error_examples": load.outcomes.errors,
            "wrong_examples": load.outcomes.wrong[:5],
            "latency_p50_s": percentile(load.latencies, 0.5),
            "latency_p99_s": percentile(load.latencies, 0.99),
        },
        "migrations": metric_sum(samples, "baton_router_migrations_total"),
        "workers_killed": len(campaign.kills),
        "kills": campaign.kills,
        "faults_injected": by_label(samples, "baton_kv_faults_injected_total", "kind"),
        "kv_transfer_failures": by_label(samples, "baton_kv_transfer_failures_total", "stage"),
        "kv_lease_expiries": metric_sum(samples, "baton_kv_lease_expiries_total"),
        "hostile": {
            "inputs_tried": sum(campaign.hostile.values()),
            "outcomes": dict(sorted(hostile_outcomes.items())),
            "by_case": {f"{f}:{n}:{o}": c for (f, n, o), c in sorted(campaign.hostile.items())},
        },
        "overload": {
            "bursts": len(campaign.overload_admitted),
            "admitted_per_burst": campaign.overload_admitted,
            "burst_refusals": len(campaign.refusal_s),
            "burst_refuse_p50_ms": ms(percentile(campaign.refusal_s, 0.5)),
            "burst_refuse_p99_ms": ms(percentile(campaign.refusal_s, 0.99)),
            "probe_refusals": len(campaign.probe_s),
            "probe_refuse_p50_ms": ms(percentile(campaign.probe_s, 0.5)),
            "probe_refuse_p99_ms": ms(refusal_p99),
        },
        "crashes": crashes,
        "traceback_lines_in_cluster_output": tracebacks,
        "settled": settled,
        "after_chaos": after,
        "cluster_exit_status": rc,
    }
    after_total = sum(after.values())
    report["goals"] = {
        "no_wrong_tokens": outcomes.get("WRONG", 0) == 0,
        "only_documented_errors": all(
            k.removeprefix("error:") in DOCUMENTED for k in outcomes if k.startswith("error:")
        ),
        "no_crash": not any(crashes.values()),
        "no_leaked_blocks": leaked == 0,
        "still_serves": after_total > 0
        and sum(n for k, n in after.items() if k.endswith(":equal")) == after_total,
        "refuse_p99_under_50ms": refusal_p99 is None or refusal_p99 < 0.05,
    }
    return report


def after_chaos(after: dict[str, int]) -> str:
    """``{"grpc:equal": 24, ...}`` as "grpc 24/24, http 6/6"."""
    parts = []
    for frontend in ("grpc", "http"):
        total = sum(n for k, n in after.items() if k.startswith(frontend + ":"))
        if total:
            parts.append(f"{frontend} {after.get(frontend + ':equal', 0)}/{total}")
    return ", ".join(parts) or "none answered"


def figures_table(report: dict) -> str:
    """The campaign's figures as a Markdown table (docs/reliability.md, bench/RESULTS.md)."""
    req, over = report["requests"], report["overload"]
    errors = ", ".join(f"{code} {n}" for code, n in sorted(req["errors"].items())) or "none"
    faults = report["faults_injected"]
    hostile = report["hostile"]
    rows = [
        ("requests sent (steady load)", req["sent"]),
        ("completed, equal to the reference", req["completed_equal"]),
        ("completed with WRONG output (goal 0)", req["completed_wrong"]),
        ("failed, by code", errors),
        ("migrated (router)", int(report["migrations"])),
        ("worker processes killed (SIGKILL)", report["workers_killed"]),
        (
            "transfer faults injected",
            ", ".join(f"{k} {int(v)}" for k, v in sorted(faults.items())) or "none",
        ),
        (
            "failed transfers recomputed on decode",
            int(report["kv_transfer_failures"].get("receive", 0)),
        ),
        ("prefill leases expired", int(report["kv_lease_expiries"])),
        ("hostile inputs tried", hostile["inputs_tried"]),
        ("hostile outcomes", ", ".join(f"{k} {n}" for k, n in hostile["outcomes"].items())),
        ("crashes (goal 0)", sum(int(v) for v in report["crashes"].values())),
        (
            "KV blocks in use once idle (goal 0)",
            sum(report["settled"].get("kv_blocks_used", {}).values()),
        ),
        ("after the chaos, answers equal to the reference", after_chaos(report["after_chaos"])),
        (
            "time to refuse under overload, p50 / p99 (goal p99 < 50 ms)",
            f"{over['probe_refuse_p50_ms']} / {over['probe_refuse_p99_ms']} ms "
            f"({over['probe_refusals']} refusals)",
        ),
        (
            "... refusals within a burst, p50 / p99 (client-side)",
            f"{over['burst_refuse_p50_ms']} / {over['burst_refuse_p99_ms']} ms "
            f"({over['burst_refusals']} refusals)",
        ),
        ("request latency p50 / p99", f"{req['latency_p50_s']:.2f} / {req['latency_p99_s']:.2f} s"),
    ]
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
