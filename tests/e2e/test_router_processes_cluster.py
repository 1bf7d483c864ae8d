"""``router.processes: 2`` on Ray: two router processes on one gRPC port (SO_REUSEPORT),
the second one's work items through the first process's Ray calls, its events on its own
channel from each worker. Streams over many connections (the kernel spreads them over
both processes) give the single-process engine's tokens; an abort sent on another
connection finds its request; the second process killed is started again and the
cluster keeps serving; SIGTERM drains both and exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from tests.e2e.conftest import cluster_config, free_port, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, request

pytestmark = pytest.mark.slow  # a Ray cluster of its own: about a minute


def _stub(address: str, index: int) -> pb_grpc.InferenceStub:
    # A distinct channel argument: a connection of its own, which the kernel gives to
    # either process.
    return pb_grpc.InferenceStub(grpc.insecure_channel(address, options=[("test.conn", index)]))


def _extra_pids(parent: int) -> list[int]:
    """The ``cluster.router_process`` children of ``parent``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and b"cluster.router_process" in cmdline:
            pids.append(int(entry.name))
    return pids


def _generate(address: str, index: int, prompt: str) -> list[int]:
    tokens = []
    for resp in _stub(address, index).Generate(request(prompt), timeout=120):
        tokens.extend((resp.final.delta if resp.HasField("final") else resp.delta).token_ids)
    return tokens


def _complete(url: str, prompt: str) -> str:
    """One OpenAI completion, on a connection of its own (urllib opens one per call)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    call = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(call, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


def test_two_router_processes_serve_abort_survive_a_kill_and_drain(
    tiny_model_dir, tmp_path, reference
):
    from workers import LLM, SamplingParams

    port = free_port()
    config = cluster_config(tiny_model_dir, http_port=port)
    config["router"]["processes"] = 2
    served = start_cluster(config, tmp_path)
    try:
        assert "baton: 2 router processes" in served.output()
        (extra,) = _extra_pids(served.process.pid)
        jobs = [(i, i % len(PROMPTS)) for i in range(16)]
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda j: _generate(served.address, j[0], PROMPTS[j[1]]), jobs))
        for (_, p), tokens in zip(jobs, outs, strict=True):
            assert tokens == reference[p]
        # HTTP: the other process serves the port too (uvicorn on an SO_REUSEPORT socket).
        llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        texts = [out.text for out in llm.generate(PROMPTS, params)]
        url = f"http://127.0.0.1:{port}/v1/completions"
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda j: _complete(url, PROMPTS[j[1]]), jobs))
        assert outs == [texts[p] for _, p in jobs]

        # Abort: the stream on one connection, the aborts on eight others (some reach
        # the other process); exactly the stream's process finds it, and says so.
        long = request(PROMPTS[0], max_tokens=400, request_id="long")
        stream = _stub(served.address, 100).Generate(long, timeout=120)
        next(stream)
        found = [
            _stub(served.address, 200 + i).Abort(pb.AbortRequest(request_id="long")).found
            for i in range(8)
        ]
        *_, last = stream
        assert found[0] and last.final.finish_reason == pb.FINISH_REASON_ABORT

        os.kill(extra, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _extra_pids(served.process.pid) in ([], [extra]):
            time.sleep(0.2)
        assert _extra_pids(served.process.pid) not in ([], [extra]), served.output()[-3000:]
        deadline = time.monotonic() + 60  # serving again: its Ready is logged
        while "router process 1 serves" not in served.output().split("exited")[-1]:
            assert time.monotonic() < deadline, served.output()[-3000:]
            time.sleep(0.2)
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda j: _generate(served.address, j[0], PROMPTS[j[1]]), jobs))
        for (_, p), tokens in zip(jobs, outs, strict=True):
            assert tokens == reference[p]
        extras = _extra_pids(served.process.pid)
    finally:
        code = stop_cluster(served)
    assert code == 0, served.output()[-4000:]
    assert "baton: stopped" in served.output()
    assert not any(Path(f"/proc/{pid}").exists() for pid in extras)  # stopped and reaped
