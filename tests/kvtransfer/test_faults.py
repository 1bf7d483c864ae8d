"""The transfer fault injector (kvtransfer/faults.py) around the real NIXL backend.

Two NIXL agents in this process (host memory, UCX) with the injector on one side; each
fault kind must end the way the hand-off promises: a failed transfer is reported as
failed and frees the owner's lease, a delayed one arrives intact, a lost notification
ends by lease expiry or by the receiver's deadline, and no block stays held on either
side. The last tests run the workers' EngineService: with ``on_failure: recompute`` a
request whose transfer failed still produces the reference tokens.
"""

from __future__ import annotations

import itertools
import threading
import time

import nixl  # noqa: F401  (required: the real backend; a broken install fails)
import pytest
import torch
from prometheus_client import REGISTRY

from cluster.tools.make_model import make_model
from kvtransfer import (
    KVConnector,
    KVLayout,
    KVTransferConfig,
    TransferFailedError,
    TransferTimeoutError,
    create_connector,
)
from kvtransfer.faults import FAULTS_ENV, FaultConfig, FaultyBackend
from kvtransfer.local_backend import LocalFabric
from kvtransfer.messages import agent_name_for
from kvtransfer.nixl_backend import NixlBackend
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.protocol.wire import OutputBatch, TokenEvent, WorkItem
from workers.serving.service import EngineService

from .helpers import empty_cache, full_kv, layout_of

HEADS = 4
_ids = itertools.count()


def test_fault_config_parses_the_environment_and_refuses_mistakes():
    cfg = FaultConfig.parse("fail_every=7, delay_ms=50,drop_notify_every=11")
    assert cfg == FaultConfig(fail_every=7, delay_ms=50.0, drop_notify_every=11)
    assert cfg.is_active and not FaultConfig().is_active
    assert FaultConfig.from_env({}) is None and FaultConfig.from_env({FAULTS_ENV: " "}) is None
    assert FaultConfig.from_env({FAULTS_ENV: "delay_ms=5,delay_every=3"}).delay_every == 3
    for bad, says in (
        ("fail_evry=3", "fail_evry"),
        ("fail_every", "KEY=VALUE"),
        ("fail_every=x", "not a number"),
        ("drop_notify_every=-1", ">= 0"),
        ("delay_every=0", "delay_every"),
    ):
        with pytest.raises(ValueError, match=says):
            FaultConfig.parse(bad)


def test_create_connector_injects_only_when_the_environment_and_the_config_ask(monkeypatch):
    cache = full_kv(4)
    layout = layout_of(cache, HEADS)
    allowed = KVTransferConfig(backend="local", allow_fault_injection=True)
    fabric = LocalFabric()
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    plain = create_connector(allowed, layout, cache, "plain", lambda *_: None, fabric=fabric)
    monkeypatch.setenv(FAULTS_ENV, "fail_every=2")
    faulty = create_connector(allowed, layout, cache, "faulty", lambda *_: None, fabric=fabric)
    refused = KVTransferConfig(backend="local")  # the variable alone: ignored
    stray = create_connector(refused, layout, cache, "stray", lambda *_: None, fabric=fabric)
    try:
        assert not isinstance(plain._backend, FaultyBackend)
        assert isinstance(faulty._backend, FaultyBackend)
        assert faulty._backend.config == FaultConfig(fail_every=2)
        assert not isinstance(stray._backend, FaultyBackend)
    finally:
        plain.close()
        faulty.close()
        stray.close()


class Side:
    """One rank with a real NIXL agent on a host-memory cache; tracks the blocks it holds."""

    def __init__(self, role, cache, direction, faults=None):
        self.worker_id = f"{role}-{next(_ids)}"
        self.cache = cache
        self.layout = layout_of(cache, HEADS)
        self.released: list[tuple[str, str]] = []
        self.held: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        config = KVTransferConfig(
            direction=direction, lease_seconds=1.5, transfer_timeout_s=0.6, idle_poll_s=0.002
        )
        backend = NixlBackend(agent_name_for(self.worker_id, "1"), cache, self.layout, config)
        self.faults = None if faults is None else FaultyBackend(backend, faults, self.worker_id)
        self.conn = KVConnector(
            self.faults or backend, self.layout, config, self.worker_id, "1", self._on_release
        )

    def _on_release(self, req_id, reason):
        with self._lock:
            self.released.append((req_id, reason))
            self.held.pop(req_id, None)

    def offer(self, req_id, block_ids):
        with self._lock:
            self.held[req_id] = tuple(block_ids)
        return self.conn.offer(req_id, block_ids, num_tokens=4 * len(block_ids), first_token_id=1)

    def injected(self, kind):
        name = "baton_kv_faults_injected_total"
        return REGISTRY.get_sample_value(name, {"instance": self.worker_id, "kind": kind})


def pair(direction, prefill_faults=None, decode_faults=None):
    src = full_kv(16, seed=3)
    p = Side("prefill", src, direction, prefill_faults)
    d = Side("decode", empty_cache(src, 0, 1, 16), direction, decode_faults)
    p.conn.add_peer(d.conn.metadata())
    d.conn.add_peer(p.conn.metadata())
    return p, d


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def close(*sides):
    for side in sides:
        side.conn.close()


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_failed_transfer_is_reported_and_frees_the_lease(direction):
    # The reader posts in pull mode, the writer in push mode: inject where the post is.
    faults = FaultConfig(fail_every=2)
    p, d = pair(direction, *((None, faults) if direction == "pull" else (faults, None)))
    injector = d if direction == "pull" else p
    try:
        ok = d.conn.receive([p.offer("ok", [1, 2])], [7, 8]).result(5)
        assert ok.num_bytes > 0 and torch.equal(d.cache[7:9], p.cache[1:3])
        with pytest.raises(TransferFailedError, match="injected fault"):
            d.conn.receive([p.offer("bad", [3, 4])], [9, 10]).result(5)
        assert not torch.any(d.cache[9:11])  # nothing was moved
        wait_until(lambda: not p.held)  # the "failed" notice ended the lease at once
        assert dict(p.released) == {"ok": "done", "bad": "failed"}
        assert injector.faults.injected == {"fail": 1}
        assert injector.injected("fail") == 1
    finally:
        close(p, d)


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_delayed_transfer_arrives_intact(direction):
    faults = FaultConfig(delay_ms=150)
    p, d = pair(direction, *((None, faults) if direction == "pull" else (faults, None)))
    injector = d if direction == "pull" else p
    try:
        start = time.monotonic()
        result = d.conn.receive([p.offer("slow", [2, 5, 6])], [0, 3, 4]).result(5)
        assert time.monotonic() - start >= 0.15  # it waited for the delayed post
        assert result.num_bytes == 3 * p.layout.block_stride
        for s, t in ((2, 0), (5, 3), (6, 4)):
            assert torch.equal(d.cache[t], p.cache[s])
        wait_until(lambda: not p.held)
        assert p.released == [("slow", "done")] and injector.injected("delay") == 1
    finally:
        close(p, d)


def test_dropped_notification_of_a_pull_ends_by_lease_expiry():
    p, d = pair("pull", decode_faults=FaultConfig(drop_notify_every=1))
    try:
        d.conn.receive([p.offer("quiet", [1, 2])], [3, 4]).result(5)
        assert torch.equal(d.cache[3:5], p.cache[1:3])  # the data came, the notice did not
        assert p.held == {"quiet": (1, 2)} and d.injected("drop_notify") == 1
        wait_until(lambda: not p.held)
        assert p.released == [("quiet", "expired")]
        assert p.conn.stats().num_leases == 0 and d.conn.stats().num_incoming == 0
    finally:
        close(p, d)


def test_dropped_notification_of_a_push_write_ends_by_the_receivers_deadline():
    p, d = pair("push", prefill_faults=FaultConfig(drop_notify_every=1))
    try:
        # The WRITE moves the data but its "done" never lands: the receive times out
        # (and its blocks are free to reuse then); P's lease ended with its write.
        with pytest.raises(TransferTimeoutError):
            d.conn.receive([p.offer("mute", [5, 6])], [7, 8]).result(5)
        wait_until(lambda: not p.held)
        assert p.released == [("mute", "done")] and p.injected("drop_notify") == 1
        assert p.conn.stats().num_outgoing == 0 and d.conn.stats().num_incoming == 0
    finally:
        close(p, d)


def test_dropped_push_request_ends_by_timeout_and_lease_expiry():
    p, d = pair("push", decode_faults=FaultConfig(drop_notify_every=1))
    try:
        # P never hears the request (nothing is written), nor the "failed" notice after
        # the receive's deadline: its lease expires.
        with pytest.raises(TransferTimeoutError):
            d.conn.receive([p.offer("unheard", [1, 2])], [3, 4]).result(5)
        assert not torch.any(d.cache[3:5]) and p.held == {"unheard": (1, 2)}
        wait_until(lambda: not p.held)
        assert p.released == [("unheard", "expired")] and d.injected("drop_notify") == 2
    finally:
        close(p, d)


# ---- the worker's reaction: recompute (or fail) ------------------------------------------
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = tuple(range(3, 40))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("faults") / "tiny", "llama", "tiny")


class Worker:
    """An EngineService on the tiny model with a real NIXL connector (made by
    ``create_connector``, so ``BATON_KV_FAULTS`` applies as in a cluster)."""

    def __init__(self, model_dir, role, on_failure="recompute", allow_faults=True):
        self.name = f"{role}-{next(_ids)}"
        config = EngineConfig(
            model=str(model_dir), max_model_len=128, block_size=8, num_kv_blocks=32,
            detokenize=False,
        )  # fmt: skip
        self.engine = LLMEngine(config)
        transfer = KVTransferConfig(
            lease_seconds=5, transfer_timeout_s=2, allow_fault_injection=allow_faults
        )

        def factory(engine, on_release):
            layout = KVLayout.from_tensor(
                engine.kv_cache, model_id="tiny", num_kv_heads=engine.arch.num_key_value_heads
            )
            return create_connector(transfer, layout, engine.kv_cache, self.name, on_release)

        self.service = EngineService(self.engine, self.name, role, factory, on_failure=on_failure)
        self.events: list[TokenEvent] = []
        self.service.attach(self._sink)

    def _sink(self, batch: OutputBatch) -> None:
        self.events.extend(batch.events)

    def final(self, request_id) -> TokenEvent:
        wait_until(lambda: any(e.finished for e in self.events if e.request_id == request_id), 60)
        return next(e for e in self.events if e.request_id == request_id and e.finished)

    def tokens(self, request_id) -> list[int]:
        return [t for e in self.events if e.request_id == request_id for t in e.token_ids]


def handoff(prefill: Worker, decode: Worker, request_id: str) -> TokenEvent:
    prefill.service.submit(WorkItem(request_id, PROMPT, PARAMS, "prefill"))
    held = prefill.final(request_id)
    decode.service.submit(
        WorkItem(request_id, PROMPT, PARAMS, "decode", held.kv_handles, held.token_ids[0])
    )
    return decode.final(request_id)


@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
def test_worker_reacts_to_an_injected_failure_as_configured(model_dir, monkeypatch, on_failure):
    reference = LLM(str(model_dir), max_model_len=128).generate([list(PROMPT)], PARAMS)[0]
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    prefill = Worker(model_dir, "prefill")
    monkeypatch.setenv(FAULTS_ENV, "fail_every=2")  # the decode worker's 2nd READ fails
    decode = Worker(model_dir, "decode", on_failure)
    try:
        prefill.service.connector.add_peer(decode.service.connector.metadata())
        decode.service.connector.add_peer(prefill.service.connector.metadata())
        for request_id in ("clean", "faulty"):
            final = handoff(prefill, decode, request_id)
            expected = list(reference.token_ids)
            if request_id == "faulty" and on_failure == "fail":
                assert final.finish_reason == "abort" and "injected fault" in final.error
            else:
                assert final.error == "" and final.finish_reason == "length"
                assert prefill.tokens(request_id)[:1] + decode.tokens(request_id) == expected
        wait_until(lambda: prefill.engine.num_held == 0)  # the "failed" notice freed it
        for worker in (prefill, decode):
            assert worker.engine.block_manager.num_used_blocks == 0
    finally:
        for worker in (prefill, decode):
            worker.service.stop()
    for worker in (prefill, decode):
        worker.engine.block_manager.check_integrity()


def test_the_variable_alone_injects_nothing(model_dir, monkeypatch, caplog):
    """``BATON_KV_FAULTS`` in a production environment: ignored, and said so in the log."""
    monkeypatch.setenv(FAULTS_ENV, "fail_every=1")  # every transfer would fail
    prefill = Worker(model_dir, "prefill", on_failure="fail", allow_faults=False)
    decode = Worker(model_dir, "decode", on_failure="fail", allow_faults=False)
    try:
        prefill.service.connector.add_peer(decode.service.connector.metadata())
        decode.service.connector.add_peer(prefill.service.connector.metadata())
        final = handoff(prefill, decode, "clean")
        assert final.error == "" and final.finish_reason == "length"
    finally:
        for worker in (prefill, decode):
            worker.service.stop()
    assert "kv_transfer.allow_fault_injection is off: ignored" in caplog.text
