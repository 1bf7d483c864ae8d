"""Live scaling on a real cluster: ``baton scale`` while requests stream (issue 38).

1 prefill + 1 decode worker (Ray actors, NIXL, gRPC). While clients stream greedy
requests without pause, ``baton scale --prefill 2`` adds a prefill worker (placed,
introduced to the decode worker both ways, routed to after its first report), and
``--prefill 1`` drains one and stops it. Every stream's tokens equal the single-process
engine's, the new worker served hand-offs, and at the end no KV block is in use.
"""

from __future__ import annotations

import threading

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, free_port, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request, wait_blocks_released

ADMIN_KEY = "e2e-admin-key-0123456789"


class Streams:
    """Client threads sending one request after another until stopped; every answer kept."""

    def __init__(self, stub, num_threads: int = 3):
        self.stub = stub
        self.results: list[tuple[int, list[int], str]] = []  # (prompt, tokens, prefill worker)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num_threads)]

    def _run(self, first: int) -> None:
        prompts = [*PROMPTS, TOKEN_PROMPT]
        i = first
        while not self._stop.is_set():
            index = i % len(prompts)
            req = request(prompts[index], disaggregation=pb.DISAGGREGATION_ALWAYS)
            req.output.return_timing = True
            try:
                tokens, _, final = collect(self.stub, req)
                self.results.append((index, tokens, final.timing.prefill_worker))
            except Exception as exc:  # counted, not raised: the test says which
                self.errors.append(f"{type(exc).__name__}: {exc}")
            i += 1

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


def test_scale_prefill_up_and_down_while_streaming(
    tiny_model_dir, reference, tmp_path, monkeypatch, capsys
):
    from cluster.cli import main as baton

    port = free_port()
    config = cluster_config(
        tiny_model_dir,
        http_port=port,
        policy="round_robin",
        scale_max_replicas=3,
        scale_down_grace_seconds=20,
    )
    served = start_cluster(config, tmp_path, env={"BATON_ADMIN_KEY": ADMIN_KEY})
    monkeypatch.setenv("BATON_ADMIN_KEY", ADMIN_KEY)
    target = ["--target", f"127.0.0.1:{port}"]
    try:
        stub = served.stub()
        with Streams(stub) as streams:
            assert baton(["scale", *target, "--prefill", "2"]) == 0
            status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
            assert [(w.name, w.healthy) for w in status.pools[0].workers] == [
                ("prefill-0", True),
                ("prefill-1", True),
            ]
            num_before = len(streams.results)
            while len(streams.results) < num_before + 12:
                threading.Event().wait(0.05)
            assert baton(["scale", *target, "--prefill", "1"]) == 0
            num_after = len(streams.results)
            while len(streams.results) < num_after + 6:
                threading.Event().wait(0.05)
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "prefill 1 -> 2, decode 1 -> 1 (added prefill-1)"
        assert out[1].startswith("prefill 2 -> 1, decode 1 -> 1 (retired prefill-")
        assert not streams.errors, streams.errors[:3]
        wrong = [(i, t) for i, t, _ in streams.results if t != reference[i]]
        assert not wrong, wrong[:3]
        used = {w for _, _, w in streams.results}
        assert {"prefill-0", "prefill-1"} <= used
        status = wait_blocks_released(stub)
        assert [p.replicas for p in status.pools] == [1, 1]
    finally:
        code = stop_cluster(served)
    assert code == 0, served.output()[-4000:]
