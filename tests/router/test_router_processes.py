"""``router.processes: N``: several router processes over the same workers.

Each router process sees every worker's reports (load and cache) but only its own
requests' events; a client's abort reaches the process that runs the request; a burst
at one process counts the others' requests; a lost worker migrates every process's
streams; a drain drains them all; and one process dying leaves the others' streams whole
(docs/serving.md, "Several router processes").
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import grpc
import pytest

from cluster.tools.make_model import make_model
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from router.errors import RouterError
from tests.router.processes_harness import MultiCluster, run_multi
from tests.router.test_migration import crash_after
from tests.router.test_router_flow import LONG_PREFIX, collect, req
from tests.router.test_torch_free import loaded
from workers import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("procs") / "tiny", "llama", "tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", max_model_len=256)


def greedy(llm, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(llm.generate([LONG_PREFIX], params)[0].token_ids)


async def until(predicate, timeout_s: float = 20.0, what: str = "") -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def num_scheduled(cluster, name: str) -> int:
    return len(cluster.services[name].engine.scheduler.requests)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_client_abort_reaches_the_process_that_runs_the_request(model_dir, num_processes):
    cluster = MultiCluster(model_dir, 0, 1, num_processes=num_processes, disaggregation="never")

    async def body(cluster):
        streams_at, aborts_at = cluster.routers[-1], cluster.routers[0]
        task = asyncio.ensure_future(collect(streams_at, req(LONG_PREFIX, 170, request_id="x")))
        await until(lambda: num_scheduled(cluster, "decode-0") == 1, what="the request runs")
        found = await aborts_at.abort("x", "")  # "": the caller of a router without keys
        missing = await aborts_at.abort("nobody", "")
        tokens, _, final = await task
        await cluster.settled()
        return found, missing, tokens, final

    found, missing, tokens, final = run_multi(cluster, body)
    assert found and not missing
    assert final.finish_reason == pb.FINISH_REASON_ABORT and len(tokens) < 170


def test_the_same_client_id_at_two_processes_at_once(model_dir, llm):
    ref = greedy(llm, 24)
    cluster = MultiCluster(model_dir, 0, 1, disaggregation="never")

    async def body(cluster):
        a, b = cluster.routers
        return await asyncio.gather(
            collect(a, req(LONG_PREFIX, 24, request_id="same")),
            collect(b, req(LONG_PREFIX, 24, request_id="same")),
        )

    for tokens, _, final in run_multi(cluster, body):
        assert tokens == ref and final.finish_reason == pb.FINISH_REASON_LENGTH


def test_a_burst_at_one_process_counts_the_requests_of_the_other(model_dir):
    """The first process holds 4 long requests on decode-0 (decode-1 is closed to it for
    the moment); the other process, which routed none of them, gets a burst of 8 before
    any report has counted them: it must fill decode-1 first (6 there, 2 on decode-0, 6
    and 6 in all). Counting only its own requests, it would split its burst 4 and 4."""
    cluster = MultiCluster(model_dir, 0, 2, disaggregation="never", policy="least_loaded")

    async def body(cluster):
        first, other = cluster.routers
        first.worker("decode-1").is_draining = True
        held = [
            asyncio.ensure_future(collect(first, req(LONG_PREFIX, 170, request_id=f"a{i}")))
            for i in range(4)
        ]
        await until(lambda: num_scheduled(cluster, "decode-0") == 4, what="4 on decode-0")
        seen = other.worker("decode-0")
        await until(lambda: seen.state().num_running == 4, what="the other sees them")
        burst = [
            asyncio.ensure_future(collect(other, req(LONG_PREFIX, 8, request_id=f"b{i}")))
            for i in range(8)
        ]
        await until(lambda: sum(len(v.routed) for v in other.decode) == 8, what="routed")
        spread = Counter({v.name: len(v.routed) for v in other.decode})
        for task in held:
            task.cancel()
        await asyncio.gather(*burst, *held, return_exceptions=True)
        await cluster.settled()
        return spread

    spread = run_multi(cluster, body)
    assert spread == {"decode-0": 2, "decode-1": 6}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_dying_decode_worker_migrates_every_process_s_streams(model_dir, llm, num_processes):
    ref = greedy(llm, 32)
    cluster = MultiCluster(
        model_dir, 0, 2, num_processes=num_processes, disaggregation="never", policy="round_robin"
    )
    crashed = crash_after(cluster, "decode", 8)

    async def body(cluster):
        runs = [
            collect(router, req(LONG_PREFIX, 32, request_id=f"{i}"))
            for router in cluster.routers
            for i in range(2)  # round robin: one on each worker, per process
        ]
        results = await asyncio.gather(*runs)
        migrated = sum(1 for _, _, final in results if final.timing.decode_worker != crashed[0])
        await cluster.settled_except(crashed)
        return results, migrated

    results, migrated = run_multi(cluster, body)
    assert len(crashed) == 1
    assert migrated == len(results) == 2 * num_processes
    for tokens, _, final in results:
        assert tokens == ref and final.finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_drain_drains_every_process(model_dir, num_processes):
    cluster = MultiCluster(model_dir, 0, 1, num_processes=num_processes, disaggregation="never")

    async def body(cluster):
        runs = [
            asyncio.ensure_future(collect(r, req(LONG_PREFIX, 170, request_id="d")))
            for r in cluster.routers
        ]
        await until(lambda: num_scheduled(cluster, "decode-0") == num_processes, what="running")
        drains = [cluster.router.drain(0.0)]
        if cluster.hub is not None:
            drains.append(cluster.hub.drain(0.0))
        aborted = sum(await asyncio.gather(*drains))
        finals = [final for _, _, final in await asyncio.gather(*runs)]
        refused = []
        for router in cluster.routers:
            with pytest.raises(RouterError) as exc:
                await collect(router, req(LONG_PREFIX, 4))
            refused.append(exc.value.code.name)
        await cluster.settled()
        return aborted, finals, refused

    aborted, finals, refused = run_multi(cluster, body)
    assert aborted == num_processes
    assert [f.finish_reason for f in finals] == [pb.FINISH_REASON_ABORT] * num_processes
    assert refused == ["UNAVAILABLE"] * num_processes


async def _grpc_stream(address: str, request_id: str, max_tokens: int, received: list) -> str:
    """A stream through a router process's gRPC port; returns how it ended."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        try:
            async for resp in stub.Generate(req(LONG_PREFIX, max_tokens, request_id=request_id)):
                delta = resp.final.delta if resp.HasField("final") else resp.delta
                received.extend(delta.token_ids)
                if resp.HasField("final"):
                    return "final"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return "closed"


def test_a_killed_router_process_leaves_the_others_streams_whole(model_dir, llm):
    """A real second process (``python -m cluster.router_process``) is killed with SIGKILL
    while both processes stream: the first's streams finish with the tokens of
    ``LLM.generate``; the workers abort the dead process's requests (every block comes
    back); the hub starts the process again, and it serves."""
    ref = greedy(llm, 160)
    cluster = MultiCluster(model_dir, 0, 1, in_process=False, disaggregation="never")

    async def body(cluster):
        hub = cluster.hub
        first = cluster.router
        mine = [asyncio.ensure_future(collect(first, req(LONG_PREFIX, 160, request_id=f"m{i}")))
                for i in range(2)]  # fmt: skip
        got: list[int] = []
        theirs = asyncio.ensure_future(_grpc_stream(cluster.addresses[0], "t", 160, got))
        await until(lambda: len(got) >= 4 and num_scheduled(cluster, "decode-0") == 3,
                    what="both processes streaming")  # fmt: skip
        old_pid = hub.pids[1]
        os.kill(old_pid, signal.SIGKILL)
        ended = await theirs
        scheduled = cluster.services["decode-0"].engine.scheduler.requests
        await until(lambda: "r1:t" not in scheduled, what="the dead process's request aborted")
        aborted_early = not any(task.done() for task in mine)  # not merely finished
        results = await asyncio.gather(*mine)
        await cluster.settled()  # the dead one's request was aborted on the worker
        await until(lambda: hub.pids.get(1) not in (None, old_pid), what="a restart")
        address = await asyncio.wait_for(hub.address(1), 60)
        again: list[int] = []
        after = await _grpc_stream(address, "t2", 8, again)
        return ended, aborted_early, results, after, again

    ended, aborted_early, results, after, again = run_multi(cluster, body)
    assert ended == "UNAVAILABLE" and aborted_early
    for tokens, _, final in results:
        assert tokens == ref and final.finish_reason == pb.FINISH_REASON_LENGTH
    assert after == "final" and again == ref[:8]


def test_the_other_router_processes_do_not_load_ray():
    """They make no Ray calls (the first process makes them): no Ray driver each."""
    assert loaded("cluster.router_process", ("ray",)) == []


class _Named:
    name, role = "decode-0", "decode"


def test_a_worker_s_load_is_the_others_as_last_reported_plus_this_process_s_own_now():
    """``WorkerView.state`` with several processes: the report counts every process's
    requests; this one's own are counted as they are now, the others' as last reported."""
    from router.workers import WorkerView
    from workers.protocol.wire import TokenEvent, WorkerReport

    view = WorkerView(client=_Named())  # type: ignore[arg-type]
    view.active = {"r1:a", "r1:b", "r1:c"}
    report = WorkerReport("decode-0", "decode", True, 7, 1, 100, 0, 0, 0)  # 8 in all
    # The batch ends "r1:c": the report, built after that step, no longer counts it.
    view.update(report, [TokenEvent("r1:c", (5,), True, "length")])
    assert view.num_mine_reported == 2  # so 8 - 2 = 6 are the other processes'
    view.active = {"r1:a", "r1:b", "r1:d", "r1:e"}  # c ended; d and e submitted since
    state = view.state()
    assert (state.num_running, state.num_waiting) == (4 + 6 - 1, 1)
    view.active = set()  # all of its own ended, no report yet: the others' 6 remain
    assert (view.state().num_running, view.state().num_waiting) == (7, 1)  # the report's


@pytest.mark.parametrize(
    "value, message",
    [
        (0, "router.processes: must be >= 1"),
        ("two", "router.processes"),
        ((os.cpu_count() or 1) + 1, "more than this host's|must be <= 64"),
    ],
)
def test_router_processes_refuses_nonsense(value, message):
    from cluster.config import parse_config
    from cluster.config_schema import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_config({"router": {"processes": value}})
    assert parse_config({}).router.processes == 1
