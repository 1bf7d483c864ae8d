"""A worker's hand-off transport (EngineService's loop) over a fake KV connector.

The tiny model runs for real; the connector only records what the worker asks of it and
lets the test decide when transfers end and leases end. What must hold, besides the
states of KVHandoff (tests/workers/test_handoff.py):

- decode: a request aborted while waiting for blocks has its handles declined, once; one
  aborted while receiving has its receive stopped and its blocks freed only when the
  receive's future completes;
- prefill: the handles go out once the offer completed; an abort then changes nothing,
  and the lease's end frees the blocks; a failed offer frees them at once.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from cluster.tools.make_model import make_model
from kvtransfer import KVHandle, TransferResult
from kvtransfer.errors import TransferAbortedError
from kvtransfer.messages import encode as encode_kv
from workers import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.handoff import HandoffState
from workers.engine.llm_engine import LLMEngine
from workers.protocol.wire import OutputBatch, TokenEvent, WorkItem
from workers.serving.service import EngineService

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = tuple(range(1, 20))  # 3 blocks of 8


class FakeConnector:
    """Records the worker's calls; the test ends receives and leases."""

    def __init__(self, on_release):
        self.on_release = on_release
        self.receives: dict[str, Future] = {}
        self.received: dict[str, tuple] = {}  # what each receive was asked: (handles, blocks)
        self.aborts: list[str] = []
        self.declines: list[str] = []
        self.offers: list[tuple[str, tuple[int, ...]]] = []
        self.fail_offers = False

    def offer(self, request_id, block_ids, *, num_tokens, first_token_id, **layout) -> KVHandle:
        if self.fail_offers:
            raise RuntimeError("no room for a lease")
        self.offers.append((request_id, tuple(block_ids)))
        return handle(request_id)

    def receive(self, handles, block_ids) -> Future:
        future: Future = Future()
        self.receives[handles[0].req_id] = future
        self.received[handles[0].req_id] = (tuple(handles), tuple(block_ids))
        return future

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def decline(self, handles, reason: str) -> None:
        self.declines.extend(h.req_id for h in handles)

    def close(self) -> None:
        pass


def handle(request_id: str, block_ids=(0, 1, 2)) -> KVHandle:
    return KVHandle("p#1", request_id, 1, block_ids, "fp", len(PROMPT), 5, 30.0, time.time())


class Worker:
    """An EngineService on the tiny model with a FakeConnector and a collecting sink."""

    def __init__(self, model_dir, role: str, **engine):
        config = dict(max_model_len=128, block_size=8, num_kv_blocks=64, detokenize=False)
        config.update(engine)
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), **config))
        self.connector: FakeConnector | None = None

        def factory(_engine, on_release):
            self.connector = FakeConnector(on_release)
            return self.connector

        self.service = EngineService(self.engine, "w", role, factory, on_failure="recompute")
        self.events: list[TokenEvent] = []
        self.service.attach(self._sink)

    def _sink(self, batch: OutputBatch) -> None:
        self.events.extend(batch.events)

    def wait(self, until, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, self.events
            time.sleep(0.01)

    def finals(self) -> dict[str, TokenEvent]:
        return {e.request_id: e for e in self.events if e.finished}

    def state(self, request_id: str) -> HandoffState | None:
        return self.engine.handoff.state(request_id)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("transport") / "tiny", "llama", "tiny")


def decode_item(request_id: str, block_ids=(0, 1, 2)) -> WorkItem:
    return WorkItem(
        request_id,
        PROMPT,
        PARAMS,
        "decode",
        kv_handles=(encode_kv(handle(request_id, block_ids)),),
        first_token_id=5,
    )


def test_decode_receives_only_the_blocks_its_prefix_cache_lacks(model_dir):
    w = Worker(model_dir, "decode")
    try:
        # A local request leaves PROMPT's first two blocks in this worker's prefix cache.
        w.service.submit(WorkItem("warm", PROMPT[:17], PARAMS, "full"))
        w.wait(lambda: "warm" in w.finals())
        w.service.submit(decode_item("c"))
        w.wait(lambda: "c" in w.connector.received)
        (sent,), block_ids = w.connector.received["c"]
        table = w.engine.block_manager.block_table("c")
        assert (sent.first_block, sent.block_ids, sent.lease_id) == (2, (2,), 1)
        assert block_ids == tuple(table[2:]) and len(table) == 3
        w.connector.receives["c"].set_result(TransferResult("c", "pull", 100, 1, 0.01))
        w.wait(lambda: "c" in w.finals())
        final = w.finals()["c"]
        assert final.finish_reason == "length" and final.num_cached_tokens == 16
        assert w.service.transport.bytes_not_received == 200  # two blocks of 100 bytes
        assert w.engine.handoff.num_reused_blocks == 2

        # P's handle covers fewer blocks than this worker holds: nothing can be read, so
        # it is declined (P frees now) and the rest of the prompt is recomputed here.
        w.service.submit(decode_item("short", block_ids=(7,)))
        w.wait(lambda: "short" in w.finals())
        assert w.connector.declines == ["short"] and "short" not in w.connector.received
        assert w.finals()["short"].finish_reason == "length"
        assert w.finals()["short"].num_cached_tokens == 16
    finally:
        w.service.stop()
    w.engine.block_manager.check_integrity()
    assert w.engine.block_manager.num_used_blocks == 0


def test_decode_aborts_before_and_while_receiving(model_dir):
    w = Worker(model_dir, "decode", max_num_seqs=1)  # "b" waits for "a"'s seat
    try:
        w.service.submit(decode_item("a"))
        w.service.submit(decode_item("b"))
        w.wait(lambda: "a" in w.connector.receives)
        assert w.state("a") is HandoffState.RECEIVING and w.state("b") is HandoffState.AWAITING
        blocks = w.engine.block_manager.num_used_blocks
        assert blocks == 3

        w.service.abort("b")  # never got blocks: P's are declined at once
        w.wait(lambda: "b" in w.finals())
        assert w.connector.declines == ["b"] and w.state("b") is None
        assert w.finals()["b"].finish_reason == "abort"

        w.service.abort("a")  # receiving: stopped, blocks kept until the receive ends
        w.wait(lambda: w.connector.aborts == ["a"])
        time.sleep(0.1)
        assert w.state("a") is HandoffState.ABORTING and "a" not in w.finals()
        assert w.engine.block_manager.num_used_blocks == blocks
        w.connector.receives["a"].set_exception(TransferAbortedError("stopped"))
        w.wait(lambda: "a" in w.finals())
        assert w.finals()["a"].finish_reason == "abort" and w.finals()["a"].error == ""
        assert w.state("a") is None and w.engine.block_manager.num_used_blocks == 0
        assert w.connector.declines == ["b"]  # "a"'s receive told P itself
    finally:
        w.service.stop()
    w.engine.block_manager.check_integrity()


def test_prefill_frees_held_blocks_at_the_lease_end_not_on_abort(model_dir):
    w = Worker(model_dir, "prefill")
    try:
        w.service.submit(WorkItem("p", PROMPT, PARAMS, "prefill"))
        w.wait(lambda: "p" in w.finals())
        (final,) = [e for e in w.events if e.request_id == "p"]
        assert final.kv_handles and final.finish_reason is None
        assert w.connector.offers == [("p", (0, 1, 2))]
        assert w.state("p") is HandoffState.LEASED

        w.service.abort("p")  # a decode worker may be reading the blocks
        time.sleep(0.1)
        assert w.state("p") is HandoffState.LEASED and w.engine.num_held == 1
        assert w.engine.block_manager.num_used_blocks == 3

        w.connector.on_release("p", "done")
        w.wait(lambda: w.engine.num_held == 0)
        assert w.state("p") is None and w.engine.block_manager.num_used_blocks == 0
        assert len(w.events) == 1  # the lease's end sends nothing

        w.connector.fail_offers = True
        w.service.submit(WorkItem("q", PROMPT, PARAMS, "prefill"))
        w.wait(lambda: "q" in w.finals())
        failed = w.finals()["q"]
        assert failed.finish_reason == "abort" and "cannot offer KV" in failed.error
        assert not failed.kv_handles and w.state("q") is None
        assert w.engine.block_manager.num_used_blocks == 0
    finally:
        w.service.stop()
    w.engine.block_manager.check_integrity()
