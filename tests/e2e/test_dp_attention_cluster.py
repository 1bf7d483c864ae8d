"""Data-parallel attention on a real Ray cluster: a tensor-parallel prefill pool (2 ranks)
hands off into a decode pool of ``attention: data_parallel``, ``expert_parallel: 2``: one
group of two one-rank decode workers (``decode-0``, ``decode-1``), each with its own
requests, KV / latent cache and NIXL agent, their MoE layers' experts split over both and
their engines in lockstep (workers/parallel/dp_group.py). Qwen3-MoE (GQA) and DeepSeek-V3
(MLA): disaggregated and aggregated outputs equal the single-process engine's token for
token (float32, greedy), requests reach both decode workers (round robin), every KV block
is released afterwards. And killing one worker of the group mid-stream fails its peer's
collectives at once: both leave routing, their streams migrate to the other group with
the same tokens, and the group is restarted together.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import grpc
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request, wait_blocks_released
from tests.e2e.test_parallel_cluster import (
    STREAM_TOKENS,
    STREAMS,
    _rank_pids,
    _wait_serving,
    streams_on_every_decode_worker,
)


def _worker_pid(served, name: str) -> int:
    """The process of worker ``name``: every worker is a ``WorkerActor`` here, told apart by
    the metric files each process writes under its pid (workers/serving/metrics_node.py),
    which carry its name as the ``instance`` label."""
    pids = _rank_pids(served, "WorkerActor")
    assert len(pids) == 5, pids  # 1 prefill + 2 groups x 2 decode workers
    label = f'"{name}"'.encode()
    root = Path(tempfile.gettempdir(), "baton-metrics")
    for pid in pids:
        if any(label in f.read_bytes() for f in root.glob(f"*/*/*_{pid}.db")):
            return pid
    raise AssertionError(f"no process of {pids} writes metrics of {name}")


def _reference(model_dir, prompts, max_tokens: int) -> list[list[int]]:
    from workers import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


def _config(model_dir, groups: int = 1, prefill_tp: int = 2) -> dict:
    config = cluster_config(model_dir, policy="round_robin")
    config["prefill"]["tensor_parallel"] = prefill_tp
    config["decode"].update(
        attention="data_parallel", expert_parallel=2, expert_dispatch="alltoall", replicas=groups
    )
    return config


@pytest.mark.slow  # a 2-rank prefill and a 2-rank decode group per model: about a minute each
@pytest.mark.parametrize("arch", ["qwen3-moe", "deepseek-v3"])
def test_tp_prefill_to_a_dp_decode_group_equals_the_single_process_engine(
    arch, tmp_path_factory, tmp_path
):
    from cluster.tools.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("e2e-dp") / "tiny", arch, "tiny")
    prompts = [*PROMPTS, TOKEN_PROMPT]
    want = _reference(model_dir, prompts, 24)
    served = start_cluster(_config(model_dir), tmp_path)
    try:
        stub = served.stub()
        decode_workers = set()
        for i, prompt in enumerate(prompts):  # round robin: each decode worker in turn
            req = request(prompt, disaggregation=pb.DISAGGREGATION_ALWAYS)
            req.output.return_timing = True
            disagg, _, final = collect(stub, req)
            decode_workers.add(final.timing.decode_worker)
            assert disagg == want[i], f"prompt {i}"
        for i, prompt in enumerate(prompts):
            agg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_NEVER))
            assert agg[0] == want[i], f"prompt {i}, aggregated"
        assert decode_workers == {"decode-0", "decode-1"}  # both ranks of the group served
        wait_blocks_released(stub)
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        decode = next(p for p in status.pools if p.role == "decode")
        assert sorted(w.name for w in decode.workers) == ["decode-0", "decode-1"]
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]


@pytest.mark.slow  # two decode groups, a kill, a group restart: a few minutes
def test_a_dead_dp_rank_fails_its_group_which_migrates_and_restarts_together(
    tmp_path_factory, tmp_path
):
    from cluster.tools.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("e2e-dp-kill") / "tiny", "qwen3-moe", "tiny")
    want = _reference(model_dir, STREAMS, STREAM_TOKENS)
    served = start_cluster(_config(model_dir, groups=2, prefill_tp=1), tmp_path)
    try:
        stub = served.stub()
        threads, results = streams_on_every_decode_worker(stub, timeout=180, busy_within=60)
        os.kill(_worker_pid(served, "decode-3"), signal.SIGKILL)  # the 2nd group's rank 1
        deadline = time.monotonic() + 30
        while True:  # both workers of the dead rank's group leave routing
            status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
            decode = next(p for p in status.pools if p.role == "decode")
            down = {w.name for w in decode.workers if not w.healthy}
            if len(down) == 2:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert down in ({"decode-0", "decode-1"}, {"decode-2", "decode-3"}), down
        for t in threads:
            t.join(180)
        failed = [r.details() for r in results.values() if isinstance(r, grpc.RpcError)]
        assert not failed and len(results) == len(STREAMS), failed
        assert all(r[0] == want[i] for i, r in results.items())
        # The group restarted together: each of its workers once, the others never.
        _wait_serving(stub, "decode", {f"decode-{i}": int(f"decode-{i}" in down) for i in range(4)})
        wait_blocks_released(stub)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
