"""Whole clusters whose pools use different tensor-parallel layouts.

Real Ray actors (one per rank, in one placement group per replica), real gloo process
groups, real NIXL transfers in which each decode rank pulls exactly its KV heads from
the prefill ranks that hold them, real gRPC. What must hold:

- prefill TP=2 -> decode TP=1 and prefill TP=1 -> decode TP=2 give, token for token,
  what the single-process engine gives (the aggregated TP=1 reference; tests/e2e/
  test_cluster.py holds the cluster's TP=1 paths to the same), disaggregated and
  aggregated, and every KV block is released afterwards on every worker;
- killing one rank of a decode replica takes the replica out of routing within seconds,
  and its streams migrate to the other decode replica: every client gets the undisturbed
  run's tokens (docs/serving.md, "Request migration"); then the replica is restarted, and
  requests routed to the new one give the same tokens. Decode replicas of TP=2 and of
  PP=2 (the killed rank is then the first stage);
- a prefill replica whose rank dies is restarted too, and its new KV agents are known to
  the decode workers (disaggregated requests give the same tokens); so are a TP=1 prefill
  and a TP=1 decode worker killed together (they restart one after the other and meet).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import grpc
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, TOKEN_PROMPT, collect, request, wait_blocks_released
from tests.e2e.test_metrics import Scrape

DEATH_DEADLINE_S = 5.0  # a dead rank's streams end within this (HEARTBEAT_S is 0.5 s)
RESTART_DEADLINE_S = 120.0  # a dead replica is serving again within this (a tiny model)
BLOCK_SIZE = 8  # cluster_config's kv_cache.block_size
MIGRATIONS = "baton_router_migrations_total"


def _block_bytes(model_dir) -> int:
    """One block of every layer, K and V, all KV heads, float32."""
    from workers.models.arch_config import ArchConfig

    arch = ArchConfig.from_model_dir(model_dir)
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * BLOCK_SIZE * arch.head_dim * 4


def _layout_config(
    model_dir, prefill_tp: int, decode_tp: int, decode_replicas: int = 1, decode_pp: int = 1
):
    config = cluster_config(model_dir)
    config["prefill"]["tensor_parallel"] = prefill_tp
    config["decode"]["tensor_parallel"] = decode_tp
    config["decode"]["pipeline_parallel"] = decode_pp
    config["decode"]["replicas"] = decode_replicas
    return config


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_mixed_layouts_match_the_single_process_engine(
    tiny_model_dir, tmp_path, reference, prefill_tp, decode_tp
):
    served = start_cluster(_layout_config(tiny_model_dir, prefill_tp, decode_tp), tmp_path)
    try:
        stub = served.stub()
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        tps = {p.role: p.workers[0].tensor_parallel for p in status.pools}
        assert tps == {"prefill": prefill_tp, "decode": decode_tp}
        assert_outputs_and_hand_off(stub, tiny_model_dir, reference)
    finally:
        assert stop_cluster(served) == 0


def assert_outputs_and_hand_off(stub, model_dir, reference) -> None:
    """Disaggregated and aggregated outputs equal the single-process engine's, every head
    of every layer of every prompt block crossed over exactly once (summed over the
    decode ranks: each pulls only the layers and heads it holds), only the last block
    when the decode worker holds the others, and no block stays in use."""
    for i, prompt in enumerate([*PROMPTS, TOKEN_PROMPT]):
        req = request(prompt, disaggregation=pb.DISAGGREGATION_ALWAYS)
        req.output.return_timing = True
        disagg = collect(stub, req)
        agg = collect(stub, request(prompt, disaggregation=pb.DISAGGREGATION_NEVER))
        assert disagg[0] == agg[0] == reference[i], f"prompt {i}"
        blocks = -(-disagg[2].usage.prompt_tokens // BLOCK_SIZE)
        assert disagg[2].timing.kv_transfer_bytes == blocks * _block_bytes(model_dir)
        # Again: the decode worker holds the prompt's full blocks now (from the aggregated
        # run) and receives only the last one, on every rank (a partial receive).
        again = collect(stub, req)
        assert again[0] == reference[i], f"prompt {i}, again"
        assert again[2].timing.kv_transfer_bytes == _block_bytes(model_dir)
    wait_blocks_released(stub)


def actor_processes(actor_class: str) -> tuple[list[int], dict[int, int]]:
    """Live processes of one actor class on this machine (Ray titles them after the class:
    ``RankActor``: follower ranks, ``WorkerActor``: rank 0 of every replica), and every
    process's parent (pid -> ppid)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,args="], capture_output=True, text=True)
    parents, found = {}, []
    for line in out.stdout.splitlines():
        pid, ppid, stat, args = line.split(maxsplit=3)
        parents[int(pid)] = int(ppid)
        if f"ray::{actor_class}" in args and not stat.startswith("Z"):
            found.append(int(pid))
    return found, parents


def _rank_pids(served, actor_class: str = "RankActor") -> list[int]:
    """Live processes of one actor class in this cluster: they descend from the serving
    process (its Ray instance's raylet started them)."""
    found, parents = actor_processes(actor_class)

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == served.process.pid:
                return True
        return False

    return [pid for pid in found if ours(pid)]


def _wait_serving(stub, role: str, restarts: dict[str, int]) -> None:
    """Poll until every replica of the pool serves, each restarted as often as
    ``restarts`` says (name -> count), within a restart's deadline. The counts matter: a
    replica whose death the router has not seen yet is healthy too."""
    deadline = time.monotonic() + RESTART_DEADLINE_S
    while True:
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        pool = next(p for p in status.pools if p.role == role)
        if {w.name: w.restarts for w in pool.workers} == restarts and all(
            w.healthy and w.state == "serving" for w in pool.workers
        ):
            assert pool.healthy_replicas == len(restarts)
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{role}: not serving again in time: {status}")
        time.sleep(0.2)


def _wait_restarting(stub, role: str, state: str = "restarting") -> set[str]:
    """Poll until some replica of the pool is out of routing (death is seen in seconds),
    and check that the status says it is being restarted (or ``state``); their names."""
    deadline = time.monotonic() + DEATH_DEADLINE_S
    while True:
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        pool = next(p for p in status.pools if p.role == role)
        if pool.healthy_replicas < pool.replicas:
            down = [w for w in pool.workers if not w.healthy]
            assert {w.state for w in down} == {state}, status
            return {w.name for w in down}
        if time.monotonic() > deadline:
            raise AssertionError(f"{role}: no replica went down: {status}")
        time.sleep(0.05)


def _serves_the_reference(stub, reference, num: int = 4) -> set[str]:
    """Disaggregated requests give the reference tokens; which decode workers served them."""
    decode_workers = set()
    for _ in range(num):
        req = request(PROMPTS[0], disaggregation=pb.DISAGGREGATION_ALWAYS)
        req.output.return_timing = True
        tokens, _, final = collect(stub, req)
        assert tokens == reference[0]
        assert final.timing.prefill_worker  # handed off: the KV crossed over
        decode_workers.add(final.timing.decode_worker)
    return decode_workers


STREAMS = [f"Stream {i}: {'different words ' * i}" for i in range(8)]
STREAM_TOKENS = 400  # long enough to be mid-stream when the rank is killed


def streams_on_every_decode_worker(
    stub, *, timeout: float, busy_within: float
) -> tuple[list[threading.Thread], dict[int, object]]:
    """Start one client thread per ``STREAMS`` prompt (``STREAM_TOKENS`` each; a thread's
    result is ``collect``'s, or the ``grpc.RpcError`` it ended with) and return once every
    decode worker runs at least one of them, so that a kill lands mid-stream."""
    results: dict[int, object] = {}

    def consume(i: int) -> None:
        req = request(STREAMS[i], max_tokens=STREAM_TOKENS)
        req.output.return_timing = True
        try:
            results[i] = collect(stub, req, timeout=timeout)
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + busy_within
    while time.monotonic() < deadline:
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        decode = next(p for p in status.pools if p.role == "decode")
        if all(w.num_running > 0 for w in decode.workers):
            return threads, results
        time.sleep(0.05)
    raise AssertionError(f"the streams did not reach every decode worker: {status}")


@pytest.fixture(scope="module")
def stream_reference(tiny_model_dir) -> list[list[int]]:
    from workers import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(STREAMS, params)]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_a_dead_decode_rank_s_streams_migrate_and_the_cluster_keeps_serving(
    tiny_model_dir, tmp_path, reference, stream_reference, tp, pp
):
    config = _layout_config(tiny_model_dir, 1, tp, decode_replicas=2, decode_pp=pp)
    config["router"]["policy"] = "round_robin"  # the streams split over both replicas
    served = start_cluster(config, tmp_path)
    try:
        assert_dead_decode_rank_migrates(served, reference, stream_reference)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
        assert "baton: stopped" in served.output()


def assert_dead_decode_rank_migrates(served, reference, stream_reference) -> None:
    """Kill rank 1 of one of two busy decode replicas (the only follower ranks of the
    cluster) mid-stream: it leaves routing within seconds, its streams migrate and every
    client gets the undisturbed tokens, it is restarted, and serves the reference again;
    no block stays in use."""
    stub = served.stub()
    pids = _rank_pids(served)
    # Rank 1 of each decode replica: with PP=2 the first stage (rank 0 is the last).
    assert len(pids) == 2, pids
    (url,) = served.metrics_urls()
    before = Scrape(url)
    threads, results = streams_on_every_decode_worker(stub, timeout=120, busy_within=30)
    os.kill(pids[0], signal.SIGKILL)
    (dead_name,) = _wait_restarting(stub, "decode")  # out of routing within seconds
    for t in threads:
        t.join(120)
    failed = [r.details() for r in results.values() if isinstance(r, grpc.RpcError)]
    assert not failed and len(results) == len(STREAMS), failed
    # Its streams moved to the other replica, and every client got the whole output.
    assert all(r[0] == stream_reference[i] for i, r in results.items())
    assert all(r[2].timing.decode_worker != dead_name for r in results.values())
    moved = Scrape(url).get(MIGRATIONS, cause="decode_worker_died")
    assert moved - before.get(MIGRATIONS, cause="decode_worker_died") >= 1
    # It is restarted: both replicas serve again, and requests routed to the new one
    # (round robin) give the same tokens as before.
    _wait_serving(stub, "decode", {"decode-0": 0, "decode-1": 0, dead_name: 1})
    assert dead_name in _serves_the_reference(stub, reference)
    wait_blocks_released(stub)


def test_a_dead_prefill_rank_is_restarted_and_meets_the_decode_workers(
    tiny_model_dir, tmp_path, reference
):
    served = start_cluster(_layout_config(tiny_model_dir, 2, 1), tmp_path)
    try:
        stub = served.stub()
        assert _serves_the_reference(stub, reference, num=1) == {"decode-0"}
        (pid,) = _rank_pids(served)  # rank 1 of the prefill replica: the only follower
        os.kill(pid, signal.SIGKILL)
        assert _wait_restarting(stub, "prefill") == {"prefill-0"}
        _wait_serving(stub, "prefill", {"prefill-0": 1})
        _serves_the_reference(stub, reference, num=2)  # both new prefill agents are known
        wait_blocks_released(stub)
        # Rank 0 of both replicas at once (the decode one has a single rank): the two
        # restarts run one after the other, and the second introduces itself to the first.
        for pid in _rank_pids(served, "WorkerActor"):
            os.kill(pid, signal.SIGKILL)
        _wait_restarting(stub, "decode")
        _wait_serving(stub, "prefill", {"prefill-0": 2})
        _wait_serving(stub, "decode", {"decode-0": 1})
        _serves_the_reference(stub, reference, num=2)
        wait_blocks_released(stub)
        # Shut down while a restart is in progress (a restart takes seconds: new actors,
        # the model's load; the shutdown reaches it within about one): it gives up and
        # removes what it placed, and the drain ends cleanly.
        (pid,) = _rank_pids(served)
        os.kill(pid, signal.SIGKILL)
        _wait_restarting(stub, "prefill")
        assert stop_cluster(served) == 0, served.output()[-4000:]
        assert "restart of prefill-0 given up" in served.output()
        assert "baton: stopped" in served.output()
    finally:
        if served.process.poll() is None:
            stop_cluster(served)


def test_without_restarts_a_dead_replica_stays_down_and_the_rest_serves(
    tiny_model_dir, tmp_path, reference
):
    """``router.restart_attempts: 0``: no restart is tried. With the prefill pool down, a
    request that must be handed off is refused (UNAVAILABLE); ``auto`` prefills on decode."""
    config = _layout_config(tiny_model_dir, 2, 1)
    config["router"]["restart_attempts"] = 0
    served = start_cluster(config, tmp_path)
    try:
        stub = served.stub()
        (pid,) = _rank_pids(served)  # rank 1 of the prefill replica
        os.kill(pid, signal.SIGKILL)
        assert _wait_restarting(stub, "prefill", state="down") == {"prefill-0"}
        with pytest.raises(grpc.RpcError) as refused:  # the cluster's default: always
            collect(stub, request(PROMPTS[0]))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy worker" in refused.value.details()
        req = request(PROMPTS[0], disaggregation=pb.DISAGGREGATION_AUTO)
        req.output.return_timing = True
        tokens, _, final = collect(stub, req)
        assert tokens == reference[0]
        assert not final.timing.prefill_worker  # prefilled on the decode worker
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        status = stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=5)
        (prefill,) = [w for p in status.pools if p.role == "prefill" for w in p.workers]
        assert (prefill.state, prefill.restarts) == ("down", 0)
        wait_blocks_released(stub)
    finally:
        assert stop_cluster(served) == 0, served.output()[-4000:]
