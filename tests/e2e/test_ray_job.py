"""The cluster as a Ray job: ``ray start --head`` on loopback, ``ray job submit ... --
python -m cluster configs/ci.yaml``, requests over gRPC, ``ray job stop`` shuts it down.

As the Helm chart deploys it, the node offers one unit of a Ray resource per pool and the
config pins each pool to it (``node_resource``)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import yaml

from cluster.client import wait_ready
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from workers.parallel.replica import free_port as _free_port

from .conftest import ROOT

# ray[default] is a dependency: its CLI sits next to this Python in any correct install.
RAY = str(Path(sys.executable).with_name("ray"))
CONFIG = "configs/ci.yaml"
POOL_RESOURCES = {"prefill": "baton_prefill", "decode": "baton_decode"}


def free_port() -> int:
    return _free_port("127.0.0.1")


def wait_gone(pattern: str, timeout_s: float) -> bool:
    """Poll until no process's command line contains ``pattern``; False at the deadline."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def ray_cli(*args, env, timeout=180, check=True):
    proc = subprocess.run(
        [RAY, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"ray {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def ray_head(tmp_path):
    assert os.path.exists(RAY), f"the ray CLI is missing: {RAY}"
    dashboard, gcs = free_port(), free_port()
    env = {
        **os.environ,
        "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}",
        "BATON_CACHE_DIR": str(tmp_path / "cache"),
        # Token authentication on, as in production: the head and every client share it.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    env.pop("RAY_JOB_ID", None)
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must be short
    # Every port explicit: another Ray instance on this machine must not collide with it.
    ray_cli(
        "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}", f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}", "--num-cpus=4", "--disable-usage-stats",
        f"--resources={json.dumps({r: 1 for r in POOL_RESOURCES.values()})}",
        f"--temp-dir={temp}", env=env,
    )  # fmt: skip
    try:
        yield env, f"127.0.0.1:{gcs}"
    finally:
        # Not `ray stop`: it would kill every Ray instance on the machine. Our head's
        # processes name our temp dir; its workers die with their raylet.
        for sig in ("-TERM", "-KILL"):
            subprocess.run(["pkill", sig, "-f", str(temp)], check=False)
            if wait_gone(str(temp), timeout_s=10):
                break
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_serves_and_ray_job_stop_shuts_down(ray_head, tmp_path):
    env, gcs_address = ray_head
    config = yaml.safe_load((ROOT / CONFIG).read_text())
    for pool, resource in POOL_RESOURCES.items():
        config[pool]["node_resource"] = resource
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = config["router"]["port"]
    runtime_env = json.dumps({"env_vars": {"BATON_CACHE_DIR": env["BATON_CACHE_DIR"]}})
    deadline = time.monotonic() + 120
    while True:  # right after `ray start` the job agent may not be up yet
        submitted = ray_cli(
            "job", "submit", "--no-wait", "--working-dir", ".", "--runtime-env-json", runtime_env,
            "--", "python", "-m", "cluster", str(config_path), env=env, check=False,
        )  # fmt: skip
        if submitted.returncode == 0:
            break
        output = submitted.stdout + submitted.stderr
        if "No available agent" not in output or time.monotonic() > deadline:
            raise AssertionError(f"ray job submit failed:\n{output}")
        time.sleep(2)
    job_id = next(
        word.strip("'\"")
        for line in submitted.stdout.splitlines()
        for word in line.split()
        if word.strip("'\"").startswith("raysubmit_")
    )
    address = f"127.0.0.1:{port}"
    try:
        try:
            with grpc.insecure_channel(address) as channel:
                wait_ready(channel, timeout_s=300)
        except TimeoutError as exc:
            logs = ray_cli("job", "logs", job_id, env=env, check=False)
            raise AssertionError(f"{exc}; the job's log:\n{logs.stdout[-4000:]}") from None
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(address))
        for mode in (pb.DISAGGREGATION_ALWAYS, pb.DISAGGREGATION_NEVER):
            req = pb.GenerateRequest(text="Ray jobs serve Baton", disaggregation=mode)
            req.stopping.max_tokens = 8
            req.stopping.ignore_eos = True
            req.output.return_timing = True
            final = list(stub.Generate(req, timeout=120))[-1].final
            assert final.usage.completion_tokens == 8
            assert final.timing.decode_worker == "decode-0"
            assert final.timing.prefill_worker == (
                "prefill-0" if mode == pb.DISAGGREGATION_ALWAYS else ""
            )
        # Each worker's placement group reserved its pool's only unit.
        status = ray_cli("status", f"--address={gcs_address}", env=env).stdout
        for resource in POOL_RESOURCES.values():
            line = re.search(rf"/([0-9.]+) {resource} \(.* of ([0-9.]+) reserved", status)
            assert line is not None, status
            assert float(line.group(1)) == float(line.group(2)) == 1.0, status
    finally:
        ray_cli("job", "stop", job_id, env=env, check=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        proc = ray_cli("job", "status", job_id, env=env)
        status = (proc.stdout + proc.stderr).lower()  # "Job '...' was stopped"
        if any(s in status for s in ("stopped", "succeeded", "failed")):
            break
        time.sleep(1)
    logs = ray_cli("job", "logs", job_id, env=env).stdout
    assert "baton: draining" in logs and "baton: stopped" in logs, logs[-3000:]
    with pytest.raises(grpc.RpcError):  # the router is gone
        pb_grpc.InferenceStub(grpc.insecure_channel(address)).GetModelInfo(
            pb.GetModelInfoRequest(), timeout=2
        )
