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
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.chaos_report import diagnose_wrong, figures_table, scrape, summarize
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


def cluster_config(model_dir: Path, args: argparse.Namespace) -> dict:
    pool = {"max_num_seqs": 16, "max_num_batched_tokens": 512}
    model = {"path": str(model_dir), "name": "chaos", "max_model_len": 512}
    model.update(dtype=args.dtype, deterministic=args.deterministic)
    return {
        "model": model,
        "prefill": {"replicas": args.prefill, **pool},
        "decode": {"replicas": args.decode, **pool},
        "kv_cache": {"block_size": 16, "num_blocks": 512},
        "kv_transfer": {
            "backend": "nixl",
            "lease_seconds": LEASE_S,
            "timeout_seconds": TRANSFER_TIMEOUT_S,
            "on_failure": "recompute",
            "direction": args.direction,
            # The campaign's $BATON_KV_FAULTS needs the explicit flag (docs/security.md).
            "allow_fault_injection": bool(args.faults),
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


class FuzzRun:
    """``bench.fuzz.run_fuzzers`` on a thread of its own, for the length of the campaign
    (it is a pytest subprocess: more load on the machine, as chaos should be)."""

    def __init__(self, examples: int):
        self.result: dict | None = None
        self._thread = None
        if examples:
            self._thread = threading.Thread(target=self._run, args=(examples,), daemon=True)
            self._thread.start()

    def _run(self, examples: int) -> None:
        from bench.fuzz import run_fuzzers

        try:
            result = run_fuzzers(examples)
        except Exception as exc:  # e.g. its own timeout: say so in the report
            self.result = {"passed": False, "total_inputs_tried": 0, "error": repr(exc)}
            return
        self.result = {
            "examples": result.examples,
            "inputs_tried": result.inputs_tried,
            "total_inputs_tried": result.total_inputs_tried,
            "passed": result.passed,
            "seconds": result.seconds,
        }
        if not result.passed:
            self.result["output_tail"] = result.output_tail

    def join(self, timeout_s: float = 1800.0) -> dict | None:
        if self._thread is not None:
            print("waiting for the fuzzers...", flush=True)
            self._thread.join(timeout_s)
        return self.result


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
        self.fuzz: dict | None = None  # bench.fuzz's result, when it ran
        self.wrong: list[dict] = []  # every WRONG answer, diagnosed (bench/chaos_report.py)

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
    # Thousands of distinct prompts, so that hand-offs, recomputes and migrations really
    # happen (24 made nearly every request a prefix-cache hit with an empty hand-off).
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="model.deterministic: every answer must equal the reference bitwise "
        "(--no-deterministic: a mismatch is reported with its margin and path)",
    )
    parser.add_argument(
        "--direction",
        default="auto",
        choices=("auto", "pull", "push"),
        help="kv_transfer.direction",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny llama)")
    parser.add_argument(
        "--fuzz-examples",
        type=int,
        default=0,
        help="also run the front ends' hypothesis fuzzers (bench/fuzz.py) with N examples "
        "each, meanwhile (0 = not)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--cluster-log", type=Path, help="write the cluster's output here")
    args = parser.parse_args()

    model_dir = args.model or ROOT / ".models/chaos-tiny-llama"
    if not (model_dir / "config.json").exists():
        from cluster.tools.make_model import make_model

        make_model(model_dir, "llama", "tiny", seed=0)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"references of {args.num_prompts} prompts (LLM API, same weights)...", flush=True)
    engine_args = {"dtype": args.dtype, "deterministic": args.deterministic}
    cases = build_workload(str(model_dir), args.num_prompts, vocab_size, args.seed, engine_args)

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
            fuzz = FuzzRun(args.fuzz_examples)
            campaign.run(load)
            load.stop()
            campaign.fuzz = fuzz.join()
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
    campaign.wrong = diagnose_wrong(str(model_dir), engine_args, load.outcomes.wrong)
    report = summarize(args, campaign, load, settled, after, samples, survived, rc, cluster)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    print(figures_table(report))
    goals = report["goals"]
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
