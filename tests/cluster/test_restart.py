"""RayRestarter's bookkeeping without Ray: the Ray steps (``cluster/replicas.py``) are faked.

What must hold: an attempt kills the old replica before placing the new one (its bundles
are needed), introduces the new one to every replica of the other pool and registers it;
a failed attempt removes what it placed and leaves the registry alone; ``close`` makes an
attempt in progress give up and remove what it placed, and no attempt starts afterwards.
The real steps run in tests/e2e/test_parallel_cluster.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster import restart
from cluster.replicas import Cancelled, Replica
from workers.engine.config import EngineConfig
from workers.protocol.wire import WorkerInfo
from workers.serving.worker_spec import WorkerSpec

INFO = WorkerInfo("prefill-0", "LlamaForCausalLM", "float32", 256, 1000, 8, 64, "cpu")


class FakeRay:
    """Stands in for the Ray steps; records what happened to which replica."""

    def __init__(self, monkeypatch, fail_start: bool = False):
        self.log: list[tuple[str, str]] = []
        self.fail_start = fail_start
        self.started = threading.Event()  # set when an attempt is starting its ranks
        self.hold = False  # start_replicas waits for the cancel event
        for name in ("place_replica", "start_replicas", "wait_ready", "introduce"):
            monkeypatch.setattr(restart, name, getattr(self, name))
        monkeypatch.setattr(restart, "kill_replica", self.kill_replica)

    def place_replica(self, spec, bundle, generation, cancel):
        self.log.append(("place", f"{spec.name}-{generation}"))
        return Replica(spec, bundle, [f"{spec.name}-{generation}-rank0"], object())

    def start_replicas(self, replicas, cancel):
        self.started.set()
        if self.hold:
            assert cancel.wait(10), "close() never came"
            raise Cancelled("the cluster is shutting down")
        if self.fail_start:
            raise RuntimeError("rank 1 failed to start")

    def wait_ready(self, replicas, cancel):
        return [INFO]

    def introduce(self, replicas, pairs, fresh):
        self.log.append(("introduce", f"{fresh}: {sorted(pairs)}"))

    def kill_replica(self, replica):
        self.log.append(("kill", replica.ranks[0]))


def registry() -> dict[str, Replica]:
    def replica(name: str) -> Replica:
        spec = WorkerSpec(
            name=name, role=name.split("-")[0], model_id="tiny", engine=EngineConfig(model="m")
        )
        return Replica(spec, {"CPU": 1.0}, [f"{name}-0-rank0"], object())

    return {n: replica(n) for n in ("prefill-0", "prefill-1", "decode-0")}


def test_an_attempt_replaces_the_replica_and_meets_the_other_pool(monkeypatch):
    fake, replicas = FakeRay(monkeypatch), registry()
    restarter = restart.RayRestarter(replicas, listener=None, reference=INFO)  # type: ignore[arg-type]
    client = asyncio.run(restarter.restart("decode-0"))
    assert fake.log == [
        ("kill", "decode-0-0-rank0"),
        ("place", "decode-0-1"),
        ("introduce", "decode-0: [('decode-0', 'prefill-0'), ('decode-0', 'prefill-1')]"),
    ]
    assert replicas["decode-0"].ranks == ["decode-0-1-rank0"]
    assert (client.name, client.role) == ("decode-0", "decode")
    fake.log.clear()
    asyncio.run(restarter.restart("prefill-1"))  # (decode, prefill) pairs either way
    assert fake.log[-1] == ("introduce", "prefill-1: [('decode-0', 'prefill-1')]")
    restarter.close()


def test_a_failed_attempt_removes_what_it_placed(monkeypatch):
    fake, replicas = FakeRay(monkeypatch, fail_start=True), registry()
    old = replicas["prefill-0"]
    restarter = restart.RayRestarter(replicas, listener=None, reference=INFO)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="rank 1 failed to start"):
        asyncio.run(restarter.restart("prefill-0"))
    assert fake.log == [
        ("kill", "prefill-0-0-rank0"),
        ("place", "prefill-0-1"),
        ("kill", "prefill-0-1-rank0"),
    ]
    assert replicas["prefill-0"] is old  # killed, and nothing new registered
    restarter.close()


def test_close_makes_an_attempt_in_progress_give_up(monkeypatch):
    fake, replicas = FakeRay(monkeypatch), registry()
    fake.hold = True
    old = replicas["decode-0"]
    restarter = restart.RayRestarter(replicas, listener=None, reference=INFO)  # type: ignore[arg-type]

    async def body():
        attempt = asyncio.ensure_future(restarter.restart("decode-0"))
        await asyncio.to_thread(fake.started.wait, 10)
        await asyncio.to_thread(restarter.close)  # returns once the attempt has ended
        with pytest.raises(Cancelled):
            await attempt
        with pytest.raises(Cancelled):
            await restarter.restart("decode-0")

    asyncio.run(body())
    assert fake.log == [
        ("kill", "decode-0-0-rank0"),
        ("place", "decode-0-1"),
        ("kill", "decode-0-1-rank0"),
    ]
    assert replicas["decode-0"] is old
