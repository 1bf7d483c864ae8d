"""Request migration in a served cluster: real Ray actors killed with SIGKILL mid-stream.

What must hold (docs/serving.md, "Request migration"): the streams of a decode worker
whose process is killed continue on the other decode worker, and each client's tokens
and text equal, token for token, the single-process engine's undisturbed greedy run; the
router counts the migrations by cause; with ``router.migration_limit: 0`` those streams
end with UNAVAILABLE naming the dead worker instead. A prefill rank killed while requests
are prefilled and handed off (slow): the prefill is routed again and every client gets
the reference tokens. A dead rank of a TP=2 / PP=2 decode replica:
tests/e2e/test_parallel_cluster.py.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request
from tests.e2e.test_metrics import Scrape
from tests.e2e.test_parallel_cluster import _rank_pids

STREAMS = [f"Stream {i}: {'different words ' * i}" for i in range(4)]
# The tiny model's whole context (its max_position_embeddings), so a stream is still
# decoding when the worker is killed: at ~1,300 tokens/s (the C++ decode path) 470 tokens
# were once over before a slow-starting sibling had streamed its fifth token.
MAX_MODEL_LEN = 1024
MAX_TOKENS = 980  # prompts <= 42 tokens
MIGRATIONS = "baton_router_migrations_total"
FAILURES = "baton_kv_transfer_failures_total"


@pytest.fixture(scope="module")
def stream_reference(tiny_model_dir) -> list[tuple[list[int], str]]:
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [(list(o.token_ids), o.text) for o in llm.generate(STREAMS, params)]


class Streams:
    """One client thread per prompt; each records its tokens as they arrive."""

    def __init__(self, stub, prompts, disaggregation=pb.DISAGGREGATION_UNSPECIFIED):
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.texts: list[list[str]] = [[] for _ in prompts]
        self.results: dict[int, object] = {}
        # Every client sends at once: none is still connecting while another finishes.
        self._start = threading.Barrier(len(prompts))
        self.threads = [
            threading.Thread(target=self._consume, args=(stub, i, p, disaggregation))
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _consume(self, stub, i, prompt, disaggregation) -> None:
        req = request(prompt, max_tokens=MAX_TOKENS, disaggregation=disaggregation)
        req.output.return_timing = True
        self._start.wait(30)
        try:
            for msg in stub.Generate(req, timeout=180):
                body = msg.delta if msg.HasField("delta") else msg.final.delta
                self.tokens[i].extend(body.token_ids)
                self.texts[i].append(body.text)
                if msg.HasField("final"):
                    self.results[i] = msg.final
        except grpc.RpcError as exc:
            self.results[i] = exc

    def wait_tokens(self, num: int, timeout_s: float = 60.0) -> None:
        """Until every stream has streamed at least ``num`` tokens."""
        deadline = time.monotonic() + timeout_s
        while min(len(t) for t in self.tokens) < num:
            assert time.monotonic() < deadline, [len(t) for t in self.tokens]
            assert not self.results, self.results  # none may end before the kill
            time.sleep(0.01)

    def join(self) -> None:
        for t in self.threads:
            t.join(180)
        assert len(self.results) == len(self.threads)


def _decode_only_config(model_dir, migration_limit: int) -> dict:
    config = cluster_config(
        model_dir, policy="round_robin", disaggregation="never", migration_limit=migration_limit
    )
    config["prefill"]["replicas"] = 0
    config["decode"]["replicas"] = 2
    config["router"]["restart_attempts"] = 0  # nothing else moves while the test looks
    config["model"]["max_model_len"] = MAX_MODEL_LEN
    return config


@pytest.mark.parametrize(
    "limit", [3, pytest.param(0, marks=pytest.mark.slow)], ids=["migrates", "limit-0"]
)
def test_a_killed_decode_worker_s_streams_continue_token_for_token(
    tiny_model_dir, tmp_path, stream_reference, limit
):
    served = start_cluster(_decode_only_config(tiny_model_dir, limit), tmp_path)
    try:
        stub = served.stub()
        (url,) = served.metrics_urls()
        before = Scrape(url)
        pids = _rank_pids(served, "WorkerActor")  # rank 0 of each replica: both decode
        assert len(pids) == 2, pids
        streams = Streams(stub, STREAMS)  # round robin: two on each worker
        streams.wait_tokens(1)  # every stream is decoding
        os.kill(pids[0], signal.SIGKILL)
        streams.join()
        after = Scrape(url)
        moved = after.get(MIGRATIONS, cause="decode_worker_died") - before.get(
            MIGRATIONS, cause="decode_worker_died"
        )
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        decode = next(p for p in status.pools if p.role == "decode")
        (dead,) = [w.name for w in decode.workers if not w.healthy]
        failed = {i: r for i, r in streams.results.items() if isinstance(r, grpc.RpcError)}
        finished = {i: r for i, r in streams.results.items() if i not in failed}
        if limit:
            # Every stream ends whole: the dead worker's two on the other one.
            assert not failed, {i: r.details() for i, r in failed.items()}
            assert moved == 2
            for i, final in finished.items():
                assert streams.tokens[i] == stream_reference[i][0], f"stream {i}"
                assert "".join(streams.texts[i]) == stream_reference[i][1], f"stream {i}"
                assert final.finish_reason == pb.FINISH_REASON_LENGTH
                assert final.timing.decode_worker != dead
        else:
            assert moved == 0 and len(failed) == 2 and len(finished) == 2
            for exc in failed.values():
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert re.match(rf"worker {dead} failed", exc.details()), exc.details()
                assert "router.migration_limit=0" in exc.details()
            for i in finished:
                assert streams.tokens[i] == stream_reference[i][0]
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_a_prefill_rank_killed_mid_hand_off_reroutes_the_prefill(
    tiny_model_dir, tmp_path, reference, on_failure
):
    """Requests flow through a TP=2 prefill replica without pause; its second rank is
    killed. Requests in prefill migrate (``prefill_worker_died``); those in hand-off
    migrate too (``transfer_failed``) with ``kv_transfer.on_failure: fail``, or their
    decode worker recomputes the prompt (``recompute``). Every client still gets the
    reference tokens, none an error."""
    config = cluster_config(tiny_model_dir, disaggregation="auto", auto_local_prefill_tokens=0)
    config["prefill"]["tensor_parallel"] = 2
    config["kv_transfer"]["on_failure"] = on_failure
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        (url,) = served.metrics_urls()
        before = Scrape(url)
        (pid,) = _rank_pids(served)  # rank 1 of the prefill replica: the only RankActor
        prompts = [*PROMPTS, TOKEN_PROMPT]
        results: list[tuple[int, object]] = []
        stop = threading.Event()

        def client(k: int) -> None:
            n = k
            while not stop.is_set():
                i = n % len(prompts)
                n += 1
                try:
                    results.append((i, collect(stub, request(prompts[i]), timeout=120)[0]))
                except grpc.RpcError as exc:
                    results.append((i, exc))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(results) < 6:
            assert time.monotonic() < deadline, results
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        done_at_kill = len(results)
        while len(results) < done_at_kill + 12:  # those in flight at the kill, and more
            assert time.monotonic() < deadline, results
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(120)
        errors = [r.details() for _, r in results if isinstance(r, grpc.RpcError)]
        assert not errors, errors
        assert all(tokens == reference[i] for i, tokens in results)
        after = Scrape(url)
        causes = ("prefill_worker_died", "transfer_failed")
        moved = sum(
            after.get(MIGRATIONS, cause=c) - before.get(MIGRATIONS, cause=c) for c in causes
        )
        assert moved >= 1
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
