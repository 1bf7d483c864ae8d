"""KV hand-offs open on another rank do not stop a pipeline replica's batches in flight.

Two real processes (gloo on CPU), a TP=1 x PP=2 replica of the tiny model, each rank
with a KV connector whose leases stay open until declined (the NIXL agents are not the
point here: what matters is that the other rank owes rank 0 news). While rank 0 decodes
with one batch per stage in flight, it offers a request's blocks on both ranks. What
must hold:

- the offer's handles (one per rank, each from its own rank) arrive while the engine
  keeps stepping, and the pipeline is never drained for it, nor for the lease left open
  on rank 1 (before, every step drained while any lease was open on another rank);
- the greedy tokens are the single-process engine's;
- declining the handles ends the lease on both ranks, and rank 0 frees the blocks
  exactly once, after both.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from cluster.tools.make_model import make_model
from kvtransfer import KVHandle
from kvtransfer.messages import decode_as as decode_kv
from tests.workers.test_tensor_parallel import (
    MAX_TOKENS,
    PROMPT_LENGTHS,
    _config,
    _generate,
    rank0_engine,
)
from workers import SamplingParams
from workers.engine.llm_engine import LLMEngine
from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica
from workers.parallel.replica_follower import RankFollower
from workers.parallel.replica_kv import ReplicaKV

NEWS_TIMEOUT_S = 30.0


class HoldingConnector:
    """A rank's connector whose leases stay open until their handles are declined."""

    def __init__(self, name: str, on_release):
        self.name = name
        self.on_release = on_release

    def offer(self, request_id, block_ids, *, num_tokens, first_token_id, **layout) -> KVHandle:
        return KVHandle(
            self.name, request_id, 1, tuple(block_ids), "fp", num_tokens, first_token_id,
            30.0, time.time(),
        )  # fmt: skip

    def decline(self, handles, reason: str) -> None:
        self.on_release(handles[0].req_id, reason)


def _rank0(model_dir: str, parallel, link) -> dict:
    offer = None
    ahead_while_open: list[int] = []  # batches in flight at each send after the offer

    def record(engine, _inputs) -> None:
        if offer is not None:
            ahead_while_open.append(engine.num_in_flight)

    kv, engine = rank0_engine(model_dir, parallel, link, record)
    released: list[str] = []
    woke = threading.Event()  # news from rank 1 came in (the reader wakes the loop)
    connector = HoldingConnector("rank0", kv.local_released)
    kv.bind(connector, lambda rid, _: released.append(rid), woke.set)
    drains: list[int] = []

    def drain() -> None:
        drains.append(engine.num_in_flight)
        engine.drain()

    kv.bind_engine(lambda: engine.num_in_flight, drain)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, length in enumerate(PROMPT_LENGTHS):
        prompt = [(37 * i + 11 * j) % (engine.vocab_size - 1) + 1 for j in range(length)]
        engine.add_request(prompt, params, f"r{i}")
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPT_LENGTHS))}
    steps = 0
    while engine.has_unfinished_requests():
        kv.poll()  # what the service's loop does every round
        if steps == 3:
            offer = kv.offer("held", [4, 5], num_tokens=9, first_token_id=17)
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
        steps += 1
    drains_while_open = list(drains)
    deadline = time.monotonic() + NEWS_TIMEOUT_S
    _poll_until(kv, woke, offer.done, deadline)
    handles = [decode_kv(h, KVHandle) for h in offer.result(timeout=0)]
    kv.decline(offer.result())
    _poll_until(kv, woke, lambda: bool(released), deadline)
    kv.close()
    return {
        "tokens": tokens,
        "drains_while_open": drains_while_open,
        "ahead_while_open": ahead_while_open,
        "handles": [[h.agent_name, h.req_id, list(h.block_ids)] for h in handles],
        "released": released,
    }


def _poll_until(kv: ReplicaKV, woke: threading.Event, done, deadline: float) -> None:
    """Take in the other rank's news each time it arrives, until ``done()``."""
    while True:
        woke.clear()
        kv.poll()
        if done() or not woke.wait(max(0.0, deadline - time.monotonic())):
            return


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    parallel, link = join_replica(rank, 2, "127.0.0.1", port, "cpu", pp_size=2)
    try:
        if rank == 0:
            result = _rank0(model_dir, parallel, link)
        else:
            engine = LLMEngine(
                _config(model_dir), parallel=parallel, agree_num_blocks=agree_min(link)
            )
            follower = RankFollower(engine, link)
            follower.connector = HoldingConnector("rank1", follower.on_release)
            follower.run()
            result = {"steps": follower.steps}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


def test_hand_offs_open_on_another_rank_keep_batches_in_flight(tmp_path):
    model_dir = str(make_model(tmp_path / "tiny", "llama", "tiny"))
    mp.start_processes(
        _rank_main,
        args=(free_port("127.0.0.1"), model_dir, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["drains_while_open"] == []  # the pipeline never emptied for news
    # Sends after the offer still found the other slot's batch in flight.
    assert max(rank0["ahead_while_open"]) == 1
    assert rank0["handles"] == [["rank0", "held", [4, 5]], ["rank1", "held", [4, 5]]]
    assert rank0["released"] == ["held"]  # once, after both ranks' leases ended
    reference = _generate(LLMEngine(_config(model_dir)))  # the single-process engine
    assert rank0["tokens"] == reference
