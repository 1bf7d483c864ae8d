"""A TP=2 prefill replica hands off into a data-parallel decode group (DP=2, EP=2): real
processes, real gloo process groups, real NIXL agents (one per rank), the workers'
``EngineService``.

Four processes: the prefill replica's two ranks (rank 0 schedules, rank 1 follows; each its
heads, or for DeepSeek's latent the whole row) and the decode group's two ranks, each its
own decode worker with its own agent, requests and cache (``decode0``, ``decode1``), their
MoE layers' experts split over both and their engines in lockstep. Rank 0 of the prefill
replica plays the router: it prefills every request and hands each request's held KV to
the one decode rank that owns it (through files here; the router's work items in the
cluster). What must hold, for Qwen3-MoE (GQA) and DeepSeek-V3 (MLA): every request's
greedy tokens equal ``LLM.generate``'s; each block of a prompt is pulled once, by the rank
that owns the request (its receive counts its own requests' blocks only, and the bytes
moved are one copy of them); afterwards no block is in use anywhere, no lease is held.
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import nixl  # noqa: F401  (required: the ranks' NIXL agents; a broken install fails)
import pytest
import torch
import torch.multiprocessing as mp

from cluster.tools.make_model import make_model
from kvtransfer import KVTransferConfig
from tests.workers.test_layerwise_replicas import (
    _connector_factory,
    _publish,
    _settled,
    _wait_file,
)
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.protocol.wire import TokenEvent, WorkItem, decode_as, encode
from workers.serving.metrics import WorkerMetrics

PROMPT_LENGTHS = (5, 16, 45, 30)
MAX_TOKENS = (10, 3, 8, 5)
OWNER = (0, 1, 0, 1)  # the decode rank of each request
ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_model_len=128,
    block_size=8,
    num_kv_blocks=64,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    detokenize=False,
)
WAIT_S = 120.0
TRANSFER = KVTransferConfig(
    backend="nixl", direction="pull", transfer_timeout_s=40, lease_seconds=60
)


def _prompt(i: int, vocab_size: int) -> tuple[int, ...]:
    return tuple((37 * i + 11 * j) % (vocab_size - 1) + 1 for j in range(PROMPT_LENGTHS[i]))


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)


def _events(service) -> queue.SimpleQueue:
    events: queue.SimpleQueue = queue.SimpleQueue()
    service.attach(lambda batch: [events.put(e) for e in batch.events])
    return events


def _next(events: queue.SimpleQueue, rid: str, want) -> TokenEvent:
    deadline = time.monotonic() + WAIT_S
    while True:
        event = events.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert not event.error, event.error
        if event.request_id == rid and want(event):
            return event


def _prefill_rank0(model_dir: str, port: int, out: Path) -> dict:
    from workers.engine.llm_engine import LLMEngine
    from workers.parallel.replica import agree_min, join_replica
    from workers.parallel.replica_kv import ReplicaKV
    from workers.serving.service import EngineService

    parallel, link = join_replica(0, 2, "127.0.0.1", port, "cpu")
    kv = ReplicaKV(link, 1, 1)  # every lease is read by one decode rank (TP 1 each)
    engine = LLMEngine(
        EngineConfig(model=model_dir, **ENGINE), parallel=parallel,
        before_forward=kv.before_forward, agree_num_blocks=agree_min(link),
    )  # fmt: skip
    service = EngineService(
        engine, "prefill", "prefill", _connector_factory("prefill", TRANSFER), replica=kv,
        metrics=WorkerMetrics("prefill", "tiny", "prefill"),
    )  # fmt: skip
    try:
        _publish(out / "meta-p0", service.connector.metadata())
        for peer in ("d0", "d1"):
            service.connector.add_peer(_wait_file(out / f"meta-{peer}"))
        _wait_file(out / "ready-p1")
        _publish(out / "ready-p", b"")
        events = _events(service)
        for i in range(len(PROMPT_LENGTHS)):
            item = WorkItem(f"r{i}", _prompt(i, engine.vocab_size), _params(i), "prefill")
            service.submit(item)
            held = _next(events, f"r{i}", lambda e: bool(e.kv_handles))
            _publish(out / f"held-r{i}", encode(held))
        for rank in (0, 1):
            _wait_file(out / f"done-d{rank}")
        _settled(service)  # every lease ended: the decode ranks' notices came
        engine.block_manager.check_integrity()
        return {"used_blocks": engine.block_manager.num_used_blocks}
    finally:
        service.stop()  # its loop sends rank 1 its stop command


def _prefill_rank1(model_dir: str, port: int, out: Path) -> dict:
    from workers.engine.llm_engine import LLMEngine
    from workers.parallel.replica import agree_min, join_replica
    from workers.parallel.replica_follower import RankFollower

    parallel, link = join_replica(1, 2, "127.0.0.1", port, "cpu")
    engine = LLMEngine(
        EngineConfig(model=model_dir, **ENGINE), parallel=parallel,
        agree_num_blocks=agree_min(link),
    )  # fmt: skip
    follower = RankFollower(engine, link, 1, 1)
    make = _connector_factory("prefill.rank1", TRANSFER)
    follower.connector = make(engine, follower.on_release)
    _publish(out / "meta-p1", follower.connector.metadata())
    for peer in ("d0", "d1"):
        follower.connector.add_peer(_wait_file(out / f"meta-{peer}"))
    _publish(out / "ready-p1", b"")
    try:
        follower.run()
    finally:
        follower.connector.close()
    return {}


def _decode_rank(dp_rank: int, model_dir: str, port: int, out: Path) -> dict:
    from workers.parallel.dp_group import DpEngine, join_dp_group
    from workers.parallel.replica_kv import ReplicaKV
    from workers.serving.service import EngineService

    parallel, lockstep = join_dp_group(dp_rank, 2, "127.0.0.1", port, "cpu")
    config = EngineConfig(model=model_dir, expert_parallel=2, **ENGINE)
    dp = DpEngine(config, parallel, lockstep)
    name = f"decode{dp_rank}"
    metrics = WorkerMetrics("decode", "tiny", name)
    service = EngineService(
        dp.engine, name, "decode", _connector_factory(name, TRANSFER), replica=ReplicaKV(),
        metrics=metrics, dp=dp,
    )  # fmt: skip
    engine = dp.engine
    try:
        _publish(out / f"meta-d{dp_rank}", service.connector.metadata())
        for peer in ("p0", "p1"):
            service.connector.add_peer(_wait_file(out / f"meta-{peer}"))
        _wait_file(out / "ready-p")
        events = _events(service)
        tokens: dict[str, list[int]] = {}
        mine = [i for i, owner in enumerate(OWNER) if owner == dp_rank]
        for i in mine:  # handed off one after the other: a decode runs while the next comes
            held = decode_as(_wait_file(out / f"held-r{i}"), TokenEvent)
            item = WorkItem(
                f"r{i}", _prompt(i, engine.vocab_size), _params(i), "decode",
                kv_handles=held.kv_handles, first_token_id=held.token_ids[0],
            )  # fmt: skip
            service.submit(item)
            tokens[f"r{i}"] = [held.token_ids[0]]
        running, deadline = set(tokens), time.monotonic() + WAIT_S
        while running:  # the requests' events interleave: each to its own list
            event = events.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert not event.error, event.error
            tokens[event.request_id].extend(event.token_ids)
            if event.finished:
                running.discard(event.request_id)
        _settled(service)
        engine.block_manager.check_integrity()
        result = {
            "tokens": tokens,
            "received_blocks": metrics._receives["prefill"][0]._value.get(),
            "transfer_bytes": metrics._transfer_bytes._sum.get(),
            "block_bytes": engine.kv_cache[0].numel() * engine.kv_cache.element_size(),
            "used_blocks": engine.block_manager.num_used_blocks,
        }
        _publish(out / f"done-d{dp_rank}", b"")
        _wait_file(out / f"done-d{1 - dp_rank}")
    finally:
        service.stop()  # both ranks' loops end together (the group's stop)
    result["steps"] = dp.num_steps
    result["group_stopped"] = dp.is_group_stopping
    return result


def _main(rank: int, model_dir: str, ports: tuple[int, int], out_dir: str) -> None:
    from workers.parallel.replica import leave_replica

    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        if rank == 0:
            result = _prefill_rank0(model_dir, ports[0], out)
        elif rank == 1:
            result = _prefill_rank1(model_dir, ports[0], out)
        else:
            result = _decode_rank(rank - 2, model_dir, ports[1], out)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


@pytest.fixture(scope="module", params=["qwen3-moe", "deepseek-v3"])
def moe_model(request, tmp_path_factory):
    path = str(make_model(tmp_path_factory.mktemp("dp-serving") / "tiny", request.param, "tiny"))
    llm = LLM(path, **ENGINE)
    vocab = llm.engine.vocab_size
    outs = llm.generate(
        [list(_prompt(i, vocab)) for i in range(len(PROMPT_LENGTHS))],
        [_params(i) for i in range(len(PROMPT_LENGTHS))],
    )
    return path, {f"r{i}": list(out.token_ids) for i, out in enumerate(outs)}


def test_tp_prefill_hands_off_into_a_dp_decode_group(moe_model, tmp_path):
    from workers.parallel.replica import free_port

    model_dir, want = moe_model
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    mp.start_processes(
        _main, args=(model_dir, ports, str(tmp_path)), nprocs=4, join=True, start_method="spawn"
    )
    prefill = json.loads((tmp_path / "rank0.json").read_text())
    assert prefill["used_blocks"] == 0
    decode = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (2, 3)]
    # Lockstep to the end: the group stopped together, after the same step.
    assert decode[0]["steps"] == decode[1]["steps"] > 0
    assert decode[0]["group_stopped"] and decode[1]["group_stopped"]
    for rank, res in enumerate(decode):
        mine = [i for i, owner in enumerate(OWNER) if owner == rank]
        assert res["tokens"] == {f"r{i}": want[f"r{i}"] for i in mine}, rank
        # Each prompt block once, by this rank, for its own requests only.
        blocks = sum(-(-PROMPT_LENGTHS[i] // ENGINE["block_size"]) for i in mine)
        assert res["received_blocks"] == blocks, rank
        assert res["transfer_bytes"] == blocks * res["block_bytes"], rank
        assert res["used_blocks"] == 0, rank
