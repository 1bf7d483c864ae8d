"""The router's side of restarting a dead worker, with fake workers and a fake restarter.

What must hold: a dead worker is replaced by the restarter's new client and becomes
routable once it reports healthy; the dead client's late frames and death notice do not
touch its replacement; failed attempts are retried with backoff, then given up with an
error (the worker stays out of routing); nothing is restarted while draining, and a
restart in progress is cancelled when the router stops.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from router.config import RouterConfig
from router.recovery import RestartPolicy
from router.router import Router
from router.status import cluster_status
from workers.protocol.wire import OutputBatch, WorkerReport

FAST = RestartPolicy(max_attempts=3, backoff_s=0.01, max_backoff_s=0.02)


class FakeClient:
    """A worker that reports healthy as soon as the router listens."""

    def __init__(self, name: str, role: str, lose_at_once: bool = False):
        self.name, self.role = name, role
        self.is_started = self.is_closed = False
        self.lose_at_once = lose_at_once  # dies while being installed
        self.on_batch = self.on_lost = None

    async def start(self) -> None:
        self.is_started = True

    def listen(self, on_batch, on_lost) -> None:
        self.on_batch, self.on_lost = on_batch, on_lost
        if self.lose_at_once:
            on_lost("died at once")
            return
        self.report(healthy=True)

    def report(self, healthy: bool, error: str = "") -> None:
        report = WorkerReport(self.name, self.role, healthy, 0, 0, 64, 0, 0, 0, error)
        self.on_batch(OutputBatch((), report))

    def close(self) -> None:
        self.is_closed = True

    async def submit(self, item) -> None: ...
    async def abort(self, request_id) -> None: ...
    async def decline(self, handles) -> None: ...


class FakeRestarter:
    """Fails its first ``num_failures`` calls; ``gate`` (if set) holds every call."""

    def __init__(self, num_failures: int = 0, die_at_once: int = 0):
        self.calls: list[str] = []
        self.clients: list[FakeClient] = []
        self.num_failures = num_failures
        self.die_at_once = die_at_once  # how many replacements die while being installed
        self.gate: asyncio.Event | None = None
        self.was_cancelled = False

    async def restart(self, name: str) -> FakeClient:
        self.calls.append(name)
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.was_cancelled = True
                raise
        if len(self.calls) <= self.num_failures:
            raise RuntimeError(f"cannot place {name}")
        role = name.split("-")[0]
        client = FakeClient(name, role, lose_at_once=len(self.clients) < self.die_at_once)
        self.clients.append(client)
        return client


def make_router(restarter: FakeRestarter | None) -> tuple[Router, dict[str, FakeClient]]:
    clients = {n: FakeClient(n, n.split("-")[0]) for n in ("prefill-0", "decode-0", "decode-1")}
    config = RouterConfig("tiny", "LlamaForCausalLM", "float32", 256, 1000, 8)
    router = Router(
        config,
        None,  # type: ignore[arg-type]  # nothing here tokenizes
        [clients["prefill-0"]],
        [clients["decode-0"], clients["decode-1"]],
        restarter=restarter,
        restart_policy=FAST,
    )
    return router, clients


def healthy(router: Router) -> dict[str, bool]:
    return {w.name: w.healthy for p in cluster_status(router).pools for w in p.workers}


def state(router: Router) -> dict[str, str]:
    return {w.name: w.state for p in cluster_status(router).pools for w in p.workers}


async def until(predicate, timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` with a deadline (the restarts here take milliseconds)."""
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


def test_a_dead_worker_is_replaced_and_routable_again():
    async def body():
        restarter = FakeRestarter()
        router, clients = make_router(restarter)
        await router.start()
        old = clients["decode-1"]
        old.on_lost("worker decode-1 closed its event channel")
        assert not healthy(router)["decode-1"] and state(router)["decode-1"] == "restarting"
        await until(lambda: restarter.clients and healthy(router)["decode-1"])
        new = restarter.clients[0]
        assert restarter.calls == ["decode-1"] and new.is_started and old.is_closed
        view = router.decode[1]
        assert view.client is new and view.is_alive and not view.active
        assert router.recovery.num_restarts == {"decode-1": 1}
        worker = next(w for p in cluster_status(router).pools for w in p.workers if w.restarts)
        assert (worker.name, worker.state, worker.healthy) == ("decode-1", "serving", True)
        assert (
            next(p for p in cluster_status(router).pools if p.role == "decode").healthy_replicas
            == 2
        )
        # The dead client's late frames and death notice concern it alone.
        old.report(healthy=False, error="late")
        old.on_lost("late")
        assert view.client is new and view.is_healthy and restarter.calls == ["decode-1"]
        # The replacement can die and be replaced in its turn.
        new.report(healthy=False, error="engine loop failed")
        await until(lambda: len(restarter.clients) == 2 and healthy(router)["decode-1"])
        assert router.recovery.num_restarts == {"decode-1": 2}
        await router.stop()

    asyncio.run(body())


def test_failed_attempts_are_retried_then_given_up(caplog):
    async def body(num_failures: int):
        restarter = FakeRestarter(num_failures=num_failures)
        router, clients = make_router(restarter)
        await router.start()
        clients["prefill-0"].on_lost("gone")
        await until(lambda: not router.recovery.is_restarting("prefill-0"))
        is_healthy = healthy(router)["prefill-0"]
        await router.stop()
        return router, restarter, is_healthy

    router, restarter, is_healthy = asyncio.run(body(num_failures=2))
    assert restarter.calls == ["prefill-0"] * 3  # the third attempt succeeds
    assert is_healthy and router.prefill[0].client is restarter.clients[0]

    with caplog.at_level(logging.WARNING, logger="router.recovery"):
        router, restarter, is_healthy = asyncio.run(body(num_failures=5))
    assert restarter.calls == ["prefill-0"] * FAST.max_attempts and not restarter.clients
    assert router.recovery.failed == {"prefill-0"} and not is_healthy
    assert state(router)["prefill-0"] == "failed"
    assert "restart 1/3 of worker prefill-0 failed: RuntimeError: cannot place" in caplog.text
    assert "worker prefill-0 stays out of routing: 3 restarts failed" in caplog.text


def test_a_replacement_that_dies_while_installed_is_restarted_again():
    async def body():
        restarter = FakeRestarter(die_at_once=1)
        router, clients = make_router(restarter)
        await router.start()
        clients["decode-0"].on_lost("gone")
        await until(lambda: len(restarter.clients) == 2 and healthy(router)["decode-0"])
        assert router.decode[0].client is restarter.clients[1]
        await router.stop()

    asyncio.run(body())


def test_no_restart_while_draining():
    async def body():
        restarter = FakeRestarter()
        router, clients = make_router(restarter)
        await router.start()
        await router.drain(grace_s=0)
        clients["decode-0"].on_lost("gone")
        # A restart's task would be registered right here, synchronously.
        assert not router.recovery.is_restarting("decode-0")
        await asyncio.sleep(0)
        assert restarter.calls == []
        assert not healthy(router)["decode-0"] and state(router)["decode-0"] == "down"
        await router.stop()

    asyncio.run(body())


async def restart_held_at_the_gate(worker: str):
    """A started router whose restarter holds the restart of ``worker`` until its gate opens."""
    restarter = FakeRestarter()
    restarter.gate = asyncio.Event()
    router, clients = make_router(restarter)
    await router.start()
    clients[worker].on_lost("gone")
    await until(lambda: restarter.calls == [worker])
    return router, clients, restarter


def test_a_restart_in_progress_is_cancelled_by_stop_and_never_installed():
    async def body():
        router, clients, restarter = await restart_held_at_the_gate("decode-1")
        await router.drain(grace_s=0)  # draining does not cancel it, stopping does
        assert router.recovery.is_restarting("decode-1")
        await router.stop()
        assert restarter.was_cancelled and not router.recovery.is_restarting("decode-1")
        assert router.decode[1].client is clients["decode-1"]

    asyncio.run(body())


def test_a_replacement_that_arrives_while_draining_is_closed_not_installed():
    async def body():
        router, clients, restarter = await restart_held_at_the_gate("decode-1")
        await router.drain(grace_s=0)
        restarter.gate.set()
        await until(lambda: not router.recovery.is_restarting("decode-1"))
        (new,) = restarter.clients
        assert new.is_closed and not new.is_started
        assert router.decode[1].client is clients["decode-1"]
        assert restarter.calls == ["decode-1"]  # no retry once draining
        await router.stop()

    asyncio.run(body())


def test_without_a_restarter_a_dead_worker_stays_out():
    async def body():
        router, clients = make_router(None)
        await router.start()
        clients["decode-0"].on_lost("gone")
        await asyncio.sleep(0)
        assert router.recovery is None and not healthy(router)["decode-0"]
        await router.stop()

    asyncio.run(body())


def test_replace_worker_refuses_a_live_worker():
    async def body():
        router, _ = make_router(None)
        await router.start()
        with pytest.raises(RuntimeError, match="alive"):
            await router.replace_worker("decode-0", FakeClient("decode-0", "decode"))
        await router.stop()

    asyncio.run(body())
