"""Time from an expert-parallel rank's death to its requests streaming again elsewhere
(issue 34: goal under 30 s on CPU).

    python -m bench.moe_rank_death --rounds 3 --json bench/moe_rank_death.json

A real cluster (`python -m cluster`: Ray actors, NIXL, gRPC) serves a tiny random Qwen3-MoE
(`baton make-model --arch qwen3-moe --size tiny`): one prefill worker, two decode replicas
of TP=2 with expert parallelism (all-to-all), round-robin routing. Each round streams 8
long greedy requests, waits until both decode replicas run some, SIGKILLs rank 1 of the
first one (its follower rank, whose peers' collectives fail at once) and records, per
stream, when its next chunk arrives: the streams of the dead replica come back after the
router saw the death and migrated them (aborted there, resent to the other replica with
the tokens the client has). Also: when the replica left routing, and when its restart
served again. Every stream's tokens are checked against the single-process engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import start_cluster, stop_cluster
from tests.e2e.test_cluster import request
from tests.e2e.test_moe_cluster import _config
from tests.e2e.test_parallel_cluster import (
    STREAM_TOKENS,
    STREAMS,
    _rank_pids,
    _wait_restarting,
    _wait_serving,
)


def _stream(stub, i: int, out: dict) -> None:
    """One request's chunks with their arrival times (monotonic)."""
    req = request(STREAMS[i], max_tokens=STREAM_TOKENS)
    req.output.return_timing = True
    times, tokens, worker = [], [], ""
    for msg in stub.Generate(req, timeout=300):
        kind = msg.WhichOneof("kind")
        body = msg.delta if kind == "delta" else msg.final.delta
        if body.token_ids:
            times.append(time.monotonic())
            tokens.extend(body.token_ids)
        if kind == "final":
            worker = msg.final.timing.decode_worker
    out[i] = (times, tokens, worker)


def _busy(stub) -> bool:
    status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
    decode = next(p for p in status.pools if p.role == "decode")
    return all(w.num_running > 0 for w in decode.workers)


def one_round(served, reference, restarts: dict[str, int]) -> dict:
    stub = served.stub()
    out: dict[int, tuple] = {}
    threads = [threading.Thread(target=_stream, args=(stub, i, out)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not _busy(stub):
        if time.monotonic() > deadline:
            raise RuntimeError("the streams did not reach both decode replicas")
        time.sleep(0.05)
    pid = _rank_pids(served)[0]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    (dead,) = _wait_restarting(served.stub(), "decode")
    left_routing = time.monotonic() - killed
    for t in threads:
        t.join(300)
    resumed = []  # seconds from the kill to each stream's next chunk
    for times, _, _ in out.values():
        after = [t for t in times if t > killed]
        if after and len(after) < len(times):  # it was mid-stream at the kill
            resumed.append(after[0] - killed)
    wrong = [i for i, (_, tokens, _) in out.items() if tokens != reference[i]]
    if wrong:
        raise RuntimeError(f"streams {wrong} differ from the single-process engine's")
    restarts[dead] += 1
    _wait_serving(stub, "decode", dict(restarts))
    return {
        "dead": dead,
        "left_routing_s": round(left_routing, 3),
        "resumed_s": sorted(round(s, 3) for s in resumed),
        "worst_resume_s": round(max(resumed), 3),
        "serving_again_s": round(time.monotonic() - killed, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from cluster.tools.make_model import make_model
    from workers import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="moe-death-"))
    model_dir = make_model(work / "tiny-qwen3-moe", "qwen3-moe", "tiny")
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    reference = [list(o.token_ids) for o in llm.generate(STREAMS, params)]
    del llm
    config = _config(model_dir, decode_replicas=2)
    config["prefill"]["tensor_parallel"] = 1
    config["router"]["policy"] = "round_robin"
    load = [os.getloadavg()[0]]
    served = start_cluster(config, work)
    rounds = []
    try:
        restarts = {"decode-0": 0, "decode-1": 0}
        for _ in range(args.rounds):
            rounds.append(one_round(served, reference, restarts))
            load.append(os.getloadavg()[0])
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        stop_cluster(served)
    worst = [r["worst_resume_s"] for r in rounds]
    summary = {
        "rounds": rounds,
        "median_worst_resume_s": statistics.median(worst),
        "median_left_routing_s": statistics.median(r["left_routing_s"] for r in rounds),
        "median_serving_again_s": statistics.median(r["serving_again_s"] for r in rounds),
        "load_average": load,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
