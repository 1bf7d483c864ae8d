"""The layer-wise KV hand-off between TP/PP replicas in serving: real processes, real gloo
process groups, real NIXL agents (one per rank), the workers' ``EngineService``.

One replica of two ranks (prefill or decode; TP=2 or PP=2) meets a one-rank worker of
the other role living in the replica's rank-0 process. The test drives the router's
three steps itself (``router/layerwise.py``): the decode worker reserves (every decode
rank, through ``ReplicaKV``), the prefill worker streams as it computes (every prefill
rank's layer hook writes its heads of its layers after each group of each chunk, one
layer per write: ``layerwise: on``), the decode worker gets the first token and decodes.
What must hold: the greedy tokens are the single-process engine's, and the whole-request
hand-off's between the same workers; a stream whose writes fail after some groups
(injected faults on the prefill ranks) is recomputed with the same tokens; afterwards
no block is in use on either worker and no stream is left on any rank.
"""

from __future__ import annotations

import json
import os
import queue
import time
from pathlib import Path

import nixl  # noqa: F401  (required: the ranks' NIXL agents; a broken install fails)
import pytest
import torch
import torch.multiprocessing as mp

from cluster.tools.make_model import make_model
from kvtransfer import KVLayout, KVTransferConfig, create_connector
from tests.workers.test_tensor_parallel import _config
from workers import SamplingParams
from workers.engine.llm_engine import LLMEngine
from workers.parallel.replica import agree_min, free_port, join_replica, leave_replica
from workers.parallel.replica_follower import RankFollower
from workers.parallel.replica_kv import ReplicaKV
from workers.protocol.wire import TokenEvent, WorkItem
from workers.serving.metrics import WorkerMetrics
from workers.serving.service import EngineService

# Past the 32-token step budget: chunked prefill, each chunk streamed group by group.
PROMPT_LENGTHS = (45, 61)
MAX_TOKENS = 8
BLOCK_SIZE = 8  # _config's
WAIT_S = 120.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompt(i: int, length: int, vocab_size: int) -> tuple[int, ...]:
    return tuple((37 * i + 11 * j) % (vocab_size - 1) + 1 for j in range(length))


def _transfer(faults: bool) -> KVTransferConfig:
    return KVTransferConfig(
        backend="nixl",
        direction="push",
        layerwise="on",
        layerwise_min_tokens=16,
        transfer_timeout_s=40,
        lease_seconds=60,
        allow_fault_injection=faults,
    )


def _connector_factory(worker_id: str, transfer: KVTransferConfig):
    def make(engine: LLMEngine, on_release):
        layout = KVLayout.from_tensor(
            engine.kv_cache,
            model_id="tiny",
            num_kv_heads=engine.arch.kv_cache_heads,
            tp_rank=engine.parallel.tp_rank,
            tp_size=engine.parallel.tp_size,
            first_layer=engine.layer_range[0],
            total_num_layers=engine.arch.num_hidden_layers,
        )
        return create_connector(transfer, layout, engine.kv_cache, worker_id, on_release)

    return make


def _publish(path: Path, data: bytes) -> None:
    """Write under a temporary name, then rename: a reader sees no file or the whole one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def _wait_file(path: Path) -> bytes:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():  # polled: another process writes it (``_publish``)
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.05)
    return path.read_bytes()


class Driver:
    """The router's part: work items in, each worker's events out."""

    def __init__(self, prefill: EngineService, decode: EngineService):
        self.prefill, self.decode = prefill, decode
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        for service in (prefill, decode):
            service.attach(lambda batch, name=service.name: self._put(name, batch.events))

    def _put(self, name: str, events) -> None:
        for event in events:
            self.events.put((name, event))

    def next(self, name: str, rid: str, want) -> TokenEvent:
        deadline = time.monotonic() + WAIT_S
        while True:
            who, event = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if who != name or event.request_id != rid:
                continue
            assert not event.error, event.error
            if want(event):
                return event

    def decode_rest(self, rid: str) -> list[int]:
        tokens = []
        while True:
            event = self.next(self.decode.name, rid, lambda e: True)
            tokens.extend(event.token_ids)
            if event.finished:
                return tokens

    def layerwise(self, rid: str, prompt: tuple[int, ...]) -> list[int]:
        p, d = self.prefill.name, self.decode.name
        self.decode.submit(WorkItem(rid, prompt, GREEDY, "decode", kv_stream_from=p))
        reserved = self.next(d, rid, lambda e: bool(e.kv_reservations))
        item = WorkItem(rid, prompt, GREEDY, "prefill", kv_reservations=reserved.kv_reservations)
        self.prefill.submit(item)
        first = self.next(p, rid, lambda e: e.kv_streamed).token_ids[0]
        item = WorkItem(rid, prompt, GREEDY, "decode", kv_stream_from=p, first_token_id=first)
        self.decode.submit(item)
        return [first, *self.decode_rest(rid)]

    def whole_request(self, rid: str, prompt: tuple[int, ...]) -> list[int]:
        self.prefill.submit(WorkItem(rid, prompt, GREEDY, "prefill"))
        held = self.next(self.prefill.name, rid, lambda e: bool(e.kv_handles))
        first = held.token_ids[0]
        item = WorkItem(rid, prompt, GREEDY, "decode", kv_handles=held.kv_handles,
                        first_token_id=first)  # fmt: skip
        self.decode.submit(item)
        return [first, *self.decode_rest(rid)]


def _settled(service: EngineService) -> None:
    deadline = time.monotonic() + WAIT_S
    engine = service.engine
    while (
        engine.block_manager.num_used_blocks
        or service.stream.outs
        or service.stream.incoming
        or service.kv.pending
        or engine.num_held
    ):
        assert time.monotonic() < deadline, f"{service.name} keeps blocks in use"
        time.sleep(0.05)


def _rank_main(rank: int, case: dict, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    if case["faults"]:  # every 3rd WRITE of the prefill ranks fails: streams break midway
        os.environ["BATON_KV_FAULTS"] = "fail_every=3"
    role, tp, pp = case["role"], case["tp"], case["pp"]
    other = "decode" if role == "prefill" else "prefill"
    transfer, out_dir = _transfer(case["faults"]), Path(out)
    parallel, link = join_replica(rank, tp * pp, "127.0.0.1", port, "cpu", pp_size=pp)
    try:
        if rank > 0:
            engine = LLMEngine(
                _config(model_dir), parallel=parallel, agree_num_blocks=agree_min(link)
            )
            follower = RankFollower(engine, link)  # a prefill replica's readers: one rank
            name = f"{role}.rank{rank}"
            follower.connector = _connector_factory(name, transfer)(engine, follower.on_release)
            _publish(out_dir / f"meta-{rank}", follower.connector.metadata())
            other_meta = _wait_file(out_dir / "meta-other")
            if not case.get("unreachable"):  # else: this rank cannot reserve for a stream
                follower.connector.add_peer(other_meta)
            _publish(out_dir / f"ready-{rank}", b"")
            try:
                follower.run()
            finally:
                num_streams = follower.connector.stats().num_streams
                follower.connector.close()
            cache = engine.kv_cache
            result = {
                "streams": num_streams,
                "layerwise": len(engine.layerwise),
                "bytes_streamed": follower.bytes_streamed,
                "block_bytes": cache[0].numel() * cache.element_size(),
            }
        else:
            os.environ.pop("BATON_KV_FAULTS", None)  # the one-rank worker writes nothing
            result = _rank0(case, parallel, link, model_dir, out_dir, other, transfer)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


def _rank0(case, parallel, link, model_dir, out_dir: Path, other: str, transfer) -> dict:
    role, world = case["role"], case["tp"] * case["pp"]
    if case["faults"]:
        os.environ["BATON_KV_FAULTS"] = "fail_every=3"
    kv = ReplicaKV(link)  # a prefill replica's readers: the one-rank decode worker
    engine = LLMEngine(
        _config(model_dir), parallel=parallel, before_forward=kv.before_forward,
        agree_num_blocks=agree_min(link),
    )  # fmt: skip
    replica = EngineService(
        engine, role, role, _connector_factory(role, transfer), replica=kv,
        metrics=WorkerMetrics(role, "tiny", f"{role}-{os.getpid()}"),
    )  # fmt: skip
    os.environ.pop("BATON_KV_FAULTS", None)
    # A one-rank prefill's whole-request lease is read by every rank of a decode replica.
    other_kv = ReplicaKV(None, *((case["tp"], case["pp"]) if role == "decode" else (1, 1)))
    alone = EngineService(
        LLMEngine(_config(model_dir)), other, other, _connector_factory(other, transfer),
        replica=other_kv, metrics=WorkerMetrics(other, "tiny", f"{other}-{os.getpid()}"),
    )  # fmt: skip
    _publish(out_dir / "meta-other", alone.connector.metadata())
    replica.connector.add_peer(alone.connector.metadata())
    alone.connector.add_peer(replica.connector.metadata())
    for rank in range(1, world):
        alone.connector.add_peer(_wait_file(out_dir / f"meta-{rank}"))
        _wait_file(out_dir / f"ready-{rank}")
    prefill, decode = (replica, alone) if role == "prefill" else (alone, replica)
    driver = Driver(prefill, decode)
    vocab = engine.vocab_size
    if case.get("unreachable"):
        return _refused(driver, replica, alone, _prompt(0, PROMPT_LENGTHS[0], vocab))
    try:
        streamed = [
            driver.layerwise(f"s{i}", _prompt(i, n, vocab)) for i, n in enumerate(PROMPT_LENGTHS)
        ]
        whole = driver.whole_request("w0", _prompt(0, PROMPT_LENGTHS[0], vocab))
        for service in (prefill, decode):
            _settled(service)
        stats = {
            "streamed": streamed,
            "whole": whole,
            "num_opened": prefill.stream.num_opened,
            "num_reserved": decode.stream.num_reserved,
            "done": prefill.metrics._streams["done"]._value.get(),
            "failed": prefill.metrics._streams["failed"]._value.get(),
            "receive_failures": decode.metrics._receive_failures._value.get(),
            "connector_streams": [s.connector.stats().num_streams for s in (prefill, decode)],
        }
        for service in (prefill, decode):
            service.engine.block_manager.check_integrity()
    finally:
        replica.stop()  # its loop sends the other rank its stop command
        alone.stop()
    return stats


def _refused(driver: Driver, replica: EngineService, alone: EngineService, prompt) -> dict:
    """Decode rank 1 knows no prefill agent: the request ends retryably, nothing held."""
    try:
        driver.decode.submit(WorkItem("x", prompt, GREEDY, "decode", kv_stream_from="prefill"))
        started = time.monotonic()
        deadline = started + WAIT_S
        while True:
            who, event = driver.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert not event.kv_reservations, "a reservation went out without rank 1's"
            if who == "decode" and event.finished:
                break
        seconds = time.monotonic() - started
        for service in (replica, alone):
            _settled(service)
            service.engine.block_manager.check_integrity()
        return {"error": event.error, "is_retryable": event.is_retryable, "seconds": seconds}
    finally:
        replica.stop()
        alone.stop()


CASES = {
    "P-tp2-to-D1": {"role": "prefill", "tp": 2, "pp": 1, "faults": False},
    "P1-to-D-tp2": {"role": "decode", "tp": 2, "pp": 1, "faults": False},
    "P-pp2-to-D1": {"role": "prefill", "tp": 1, "pp": 2, "faults": False},
    "P1-to-D-pp2": {"role": "decode", "tp": 1, "pp": 2, "faults": False},
    "P-tp2-faults": {"role": "prefill", "tp": 2, "pp": 1, "faults": True},
    # DeepSeek's latent cache, whole on both prefill ranks: each block written by one of
    # them, round robin (kvtransfer/stream.py); a block written by none would be zeros.
    "MLA-P-tp2-to-D1": {
        "role": "prefill",
        "tp": 2,
        "pp": 1,
        "faults": False,
        "arch": "deepseek-v3",
    },
}

_models: dict[str, tuple[str, list[list[int]]]] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(model directory, the single-process engine's tokens) by architecture, made once."""

    def get(arch: str) -> tuple[str, list[list[int]]]:
        if arch not in _models:
            path = tmp_path_factory.mktemp(f"layerwise-replicas-{arch}") / "tiny"
            model_dir = str(make_model(path, arch, "tiny"))
            _models[arch] = (model_dir, _reference(model_dir))
        return _models[arch]

    yield get
    _models.clear()


def _reference(model_dir: str) -> list[list[int]]:
    engine = LLMEngine(_config(model_dir))
    for i, n in enumerate(PROMPT_LENGTHS):
        engine.add_request(list(_prompt(i, n, engine.vocab_size)), GREEDY, f"r{i}")
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPT_LENGTHS))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return [tokens[f"r{i}"] for i in range(len(PROMPT_LENGTHS))]


@pytest.mark.parametrize("case", list(CASES))
def test_layerwise_streams_between_replicas_give_the_engines_tokens(case, models, tmp_path):
    spec = CASES[case]
    model_dir, reference = models(spec.get("arch", "llama"))
    mp.start_processes(
        _rank_main,
        args=(spec, free_port("127.0.0.1"), model_dir, str(tmp_path)),
        nprocs=spec["tp"] * spec["pp"],
        join=True,
        start_method="spawn",
    )
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["streamed"] == reference
    assert rank0["whole"] == reference[0]
    assert rank0["num_opened"] == rank0["num_reserved"] == len(PROMPT_LENGTHS)
    if spec["faults"]:
        assert rank0["failed"] >= 1 and rank0["receive_failures"] >= 1  # recomputed
    else:
        assert rank0["done"] == len(PROMPT_LENGTHS) and rank0["failed"] == 0
        assert rank0["receive_failures"] == 0
    assert rank0["connector_streams"] == [0, 0]
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert follower["streams"] == 0 and follower["layerwise"] == 0  # nothing left there
    if spec["role"] == "prefill" and not spec["faults"]:
        # Rank 1 wrote its part of every prompt block (its heads, or its stage's layers);
        # of a latent cache only its round-robin share: the odd blocks (for decode rank 0).
        num_blocks = sum(-(-n // BLOCK_SIZE) for n in PROMPT_LENGTHS)
        if "arch" in spec:
            num_blocks = sum(-(-n // BLOCK_SIZE) // 2 for n in PROMPT_LENGTHS)
        assert follower["bytes_streamed"] == num_blocks * follower["block_bytes"]


def test_a_decode_rank_that_cannot_reserve_ends_the_request_retryably(models, tmp_path):
    """The router would migrate it; no reservation went out, no block stays in use."""
    spec = {"role": "decode", "tp": 2, "pp": 1, "faults": False, "unreachable": True}
    model_dir, _ = models("llama")
    mp.start_processes(
        _rank_main,
        args=(spec, free_port("127.0.0.1"), model_dir, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert "cannot reserve KV blocks: rank 1: KVTransferError" in rank0["error"]
    assert rank0["is_retryable"]
    # Withdrawn at once on every rank, not left to the receive's deadline (40 s).
    assert rank0["seconds"] < 15
