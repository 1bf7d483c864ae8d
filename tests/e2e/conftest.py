"""A real cluster for the whole-cluster tests: ``python -m cluster CONFIG`` in a subprocess.

It starts a local Ray instance, one prefill and one decode worker (Ray actors with real
engines and NIXL agents) and the gRPC router on a free loopback port, exactly as a user
would; the tests talk to it over gRPC. Teardown sends SIGTERM and checks the drain ends
the process cleanly.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from proto.baton.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer KEY`` to every call (a cluster with API keys)."""

    def __init__(self, key: str):
        self.metadata = (("authorization", f"Bearer {key}"),)

    def _with_key(self, details):
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self.metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


@dataclass
class ServedCluster:
    process: subprocess.Popen
    address: str
    model_dir: Path
    lines: list[str]
    api_key: str | None = None  # sent with every call of stub() when set

    def stub(self) -> pb_grpc.InferenceStub:
        channel = grpc.insecure_channel(self.address)
        if self.api_key:
            channel = grpc.intercept_channel(channel, _Bearer(self.api_key))
        return pb_grpc.InferenceStub(channel)

    def output(self) -> str:
        return "\n".join(self.lines)

    def metrics_urls(self) -> list[str]:
        """Every node's scrape endpoint, from the "baton: metrics on URL" lines."""
        prefix = "baton: metrics on "
        return [line[len(prefix) :] for line in self.lines if line.startswith(prefix)]


def start_cluster(
    config: dict, workdir: Path, env: dict | None = None, argv: list[str] | None = None
) -> ServedCluster:
    """``argv`` (default ``python -m cluster``) gets the config's path appended; it runs in a
    session (and process group) of its own, as under systemd or a shell's job control."""
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [*(argv or [sys.executable, "-m", "cluster"]), str(path)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A Ray instance of its own, whatever else runs on this machine.
        env={**os.environ, "RAY_ADDRESS": "local", **(env or {})},
    )
    lines: list[str] = []
    ready = threading.Event()
    served_on: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip())
            if line.startswith("baton: serving"):
                # "baton: serving NAME on HOST:PORT (...)": the port the router really bound.
                served_on.append(line.split(" on ", 1)[1].split(" ", 1)[0])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("cluster did not start:\n" + "\n".join(lines[-60:]))
    address = served_on[0]
    return ServedCluster(process, address, Path(config["model"].get("path") or ""), lines)


def stop_cluster(cluster: ServedCluster, timeout_s: float = 90.0) -> int:
    cluster.process.send_signal(signal.SIGTERM)
    try:
        return cluster.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        cluster.process.kill()
        raise


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from cluster.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("e2e") / "tiny-llama", "llama", "tiny")


# Below Linux's ephemeral range (32768-60999: every outgoing connection, Ray's and gRPC's
# included, takes its local port there) and above Ray's worker ports (10002-19999).
_FIXED_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port for a listener the cluster binds itself a moment later (the HTTP API: port 0
    would turn it off). Drawn outside the ranges the machine hands out on its own, so that
    nothing else takes it in between, as a kernel-chosen port once was."""
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.choice(_FIXED_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_FIXED_PORTS}")


def cluster_config(model_dir: Path, **router) -> dict:
    return {
        "model": {"path": str(model_dir), "name": "tiny", "max_model_len": 512},
        "prefill": {"replicas": 1, "max_num_seqs": 16, "max_num_batched_tokens": 256},
        "decode": {"replicas": 1, "max_num_seqs": 40, "max_num_batched_tokens": 256},
        "kv_cache": {"block_size": 8, "num_blocks": 1024},
        "kv_transfer": {"backend": "nixl", "lease_seconds": 20, "timeout_seconds": 5},
        "router": {
            # Any free port, bound by the router itself (a port picked here could be
            # taken by another process before the router binds it).
            "port": 0,
            "http_port": 0,  # no HTTP unless a test asks (tests/e2e/test_openai_api.py)
            "policy": "kv_aware",
            "disaggregation": "always",
            "max_queued_requests": 48,
            "drain_grace_seconds": 5,
            **router,
        },
        "metrics": {"port": 0},  # any free port, printed (tests may run side by side)
    }


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    served = start_cluster(cluster_config(tiny_model_dir), tmp_path_factory.mktemp("cluster"))
    yield served
    code = stop_cluster(served)
    assert code == 0, served.output()[-4000:]
    assert "baton: stopped" in served.output()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[int, list[int]]:
    """The single-process engine's greedy tokens for test_cluster's PROMPTS and
    TOKEN_PROMPT (24 each, EOS ignored): what every cluster layout must give."""
    from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [*PROMPTS, TOKEN_PROMPT]
    return {i: list(out.token_ids) for i, out in enumerate(llm.generate(prompts, params))}
