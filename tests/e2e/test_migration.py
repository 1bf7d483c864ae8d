"""Request migration in a served cluster: real Ray actors killed with SIGKILL mid-stream.

What must hold (docs/serving.md, "Request migration"): the streams of a decode worker
whose process is killed continue on the other decode worker, and each client's tokens
and text equal, token for token, the single-process engine's undisturbed greedy run; the
router counts the migrations by cause; with ``router.migration_limit: 0`` those streams
end with UNAVAILABLE naming the dead worker instead. A dead rank of a TP/PP replica and a
prefill worker killed mid hand-off: tests/e2e/test_parallel_cluster.py and the slow case
below.
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
from tests.e2e.test_cluster import request
from tests.e2e.test_metrics import Scrape
from tests.e2e.test_parallel_cluster import _rank_pids

STREAMS = [f"Stream {i}: {'different words ' * i}" for i in range(4)]
MAX_TOKENS = 300  # long enough to be mid-stream when the worker is killed
MIGRATIONS = "baton_router_migrations_total"


@pytest.fixture(scope="module")
def stream_reference(tiny_model_dir) -> list[tuple[list[int], str]]:
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [(list(o.token_ids), o.text) for o in llm.generate(STREAMS, params)]


class Streams:
    """One client thread per prompt; each records its tokens as they arrive."""

    def __init__(self, stub, prompts, disaggregation=pb.DISAGGREGATION_UNSPECIFIED):
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.texts: list[list[str]] = [[] for _ in prompts]
        self.results: dict[int, object] = {}
        self.threads = [
            threading.Thread(target=self._consume, args=(stub, i, p, disaggregation))
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _consume(self, stub, i, prompt, disaggregation) -> None:
        req = request(prompt, max_tokens=MAX_TOKENS, disaggregation=disaggregation)
        req.output.return_timing = True
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
        streams.wait_tokens(5)
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
