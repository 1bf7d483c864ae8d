"""A served cluster with ``model.deterministic: true`` in bfloat16: real Ray actors, real
NIXL, real gRPC, one prefill and two decode workers, n-gram speculation on the decode pool.

What must hold (docs/engine.md, "Deterministic mode"): for prompts of ~300 tokens (where
bfloat16 without the mode gave different tokens disaggregated and aggregated), every
answer equals ``LLM.generate``'s in the same mode, tokens and logprobs to the bit:
disaggregated (KV over NIXL), aggregated on a decode worker whose prefix cache already
holds the prompt from the hand-off, disaggregated again with both caches warm, and after
a decode worker is SIGKILLed mid-stream and its streams are recomputed on the other one;
with the KV cache in bfloat16 and in FP8. The engine-level axes one by one (logits, not
only tokens): tests/workers/test_deterministic.py.
"""

from __future__ import annotations

import os
import random
import signal
import threading

import grpc
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import request, wait_blocks_released
from tests.e2e.test_metrics import Scrape
from tests.e2e.test_parallel_cluster import _rank_pids

MAX_MODEL_LEN = 1024  # the tiny model's whole context: streams long enough to kill one
SHORT, LONG = 24, 600
MIGRATIONS = "baton_router_migrations_total"


def prompts() -> list[list[int]]:
    """Four prompts of ~300 tokens; each repeats a motif, so n-gram proposals are made."""
    rng = random.Random(40)
    out = []
    for n in (290, 301, 317, 333):
        motif = [rng.randrange(3, 1000) for _ in range(13)]
        body = [rng.randrange(3, 1000) for _ in range(n - 4 * len(motif))]
        out.append(body + motif * 4)
    return out


def answer(stub, prompt, max_tokens, disaggregation) -> tuple[list[int], list[tuple]]:
    """(tokens, per token (logprob, top-3 (id, logprob))) of one greedy request."""
    req = request(prompt, max_tokens=max_tokens, disaggregation=disaggregation)
    req.output.logprobs = 3
    tokens, logprobs = [], []
    for msg in stub.Generate(req, timeout=120):
        body = msg.delta if msg.HasField("delta") else msg.final.delta
        tokens.extend(body.token_ids)
        for lp in body.logprobs:
            logprobs.append((lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)))
    return tokens, logprobs


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def _reference(model_dir, kv_dtype) -> list[tuple[list[int], list[tuple]]]:
    from workers import LLM, SamplingParams

    llm = LLM(
        str(model_dir), dtype="bfloat16", deterministic=True, kv_cache_dtype=kv_dtype,
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True, logprobs=3)
    out = []
    for o in llm.generate(prompts(), params):
        lps = [
            (lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))
            for lp in o.logprobs
        ]
        out.append((list(o.token_ids), lps))
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", pytest.param("fp8_e4m3", marks=pytest.mark.slow)])
def test_every_path_gives_the_engine_s_bits(model_dir, tmp_path, kv_dtype):
    want = _reference(model_dir, kv_dtype)
    assert all(len(set(tokens)) > 5 for tokens, _ in want)  # not degenerate
    config = cluster_config(model_dir, policy="round_robin", migration_limit=3)
    config["model"].update(dtype="bfloat16", deterministic=True, max_model_len=MAX_MODEL_LEN)
    config["kv_cache"]["dtype"] = kv_dtype
    config["decode"]["replicas"] = 2
    config["decode"]["speculative"] = {"method": "ngram", "num_tokens": 3}
    config["router"]["restart_attempts"] = 0  # nothing else moves while the test looks
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        for p, (tokens, lps) in zip(prompts(), want, strict=True):
            short = (tokens[:SHORT], lps[:SHORT])
            assert answer(stub, p, SHORT, pb.DISAGGREGATION_ALWAYS) == short, "cold hand-off"
            for _ in range(2):  # round robin: each decode worker, its cache warm from above
                assert answer(stub, p, SHORT, pb.DISAGGREGATION_NEVER) == short, "aggregated"
            assert answer(stub, p, SHORT, pb.DISAGGREGATION_ALWAYS) == short, "warm hand-off"
        wait_blocks_released(stub)
        _kill_a_decode_worker_mid_stream(served, stub, want)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]


def _kill_a_decode_worker_mid_stream(served, stub, want) -> None:
    (url,) = served.metrics_urls()
    before = Scrape(url).get(MIGRATIONS, cause="decode_worker_died")
    pids = _rank_pids(served, "WorkerActor")  # rank 0 of each replica: all three
    cpu_before = {pid: _cpu_ticks(pid) for pid in pids}
    results: dict[int, object] = {}
    started = [0] * len(want)
    progress = threading.Condition()  # notified on every streamed message and every end
    barrier = threading.Barrier(len(want))

    def client(i: int) -> None:
        # Aggregated: the prefill worker stays idle, so the busiest process is a decode one.
        req = request(prompts()[i], max_tokens=LONG, disaggregation=pb.DISAGGREGATION_NEVER)
        req.output.logprobs = 3
        tokens, lps = [], []
        barrier.wait(30)
        try:
            for msg in stub.Generate(req, timeout=180):
                body = msg.delta if msg.HasField("delta") else msg.final.delta
                tokens.extend(body.token_ids)
                with progress:
                    started[i] = len(tokens)
                    progress.notify_all()
                for lp in body.logprobs:
                    lps.append((lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)))
            result: object = (tokens, lps)
        except grpc.RpcError as exc:
            result = exc
        with progress:
            results[i] = result
            progress.notify_all()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(want))]
    for t in threads:
        t.start()
    with progress:  # until every stream is decoding (none may end first)
        progress.wait_for(lambda: min(started) >= 2 or results, timeout=60)
        assert min(started) >= 2 and not results, (started, results)
    busiest = max(pids, key=lambda pid: _cpu_ticks(pid) - cpu_before[pid])
    os.kill(busiest, signal.SIGKILL)
    for t in threads:
        t.join(180)
    moved = Scrape(url).get(MIGRATIONS, cause="decode_worker_died") - before
    assert moved >= 1, "no stream was on the killed worker"
    for i, got in results.items():
        assert not isinstance(got, grpc.RpcError), got.details()
        assert got == want[i], f"stream {i}"


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process so far, in clock ticks (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
