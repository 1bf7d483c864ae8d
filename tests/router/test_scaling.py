"""Live scaling's router side (router/scaling.py) with fake workers and a fake provisioner.

What must hold: each lifecycle step is allowed from its phases only; a new worker is not
routable before its first healthy report and is once ``scale_to`` returns; the worker
drained is the least loaded, takes nothing new, is retired only once its requests ended
and its blocks are free, then leaves the router and is stopped; a death while joining or
draining is not restarted; bad targets, no room and a draining router are refused with
the reason; the admin route needs the admin key, and ``baton scale`` drives it. The flow
over real engines (tokens, migration past the grace, blocks) is test_scaling_flow.py.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from cluster.cli import main as baton
from cluster.planner.actuator import Scaler, VirtualScaler
from router.config import RouterConfig
from router.http.admin import AdminKey
from router.http.server import HttpServer
from router.policy import NoHealthyWorker, RouteRequest, WorkerState, pick, route
from router.router import Router
from router.scaling import InvalidTransition, Phase, ScaleError, WorkerLifecycle
from router.workers import Expected
from tests.router.test_recovery import FAST, FakeClient, FakeRestarter, until
from workers.protocol.wire import OutputBatch, WorkerReport

ADMIN_KEY = "admin-key-0123456789abcdef"


class QuietClient(FakeClient):
    """A worker that reports only when told (``say``), with the load it is given."""

    def __init__(self, name: str, role: str, die_at_once: bool = False):
        super().__init__(name, role, lose_at_once=die_at_once)
        self.say_at_listen = False

    def listen(self, on_batch, on_lost) -> None:
        self.on_batch, self.on_lost = on_batch, on_lost
        if self.lose_at_once:
            on_lost("died at once")
        elif self.say_at_listen:
            self.say()

    def say(self, num_running: int = 0, kv_blocks_used: int = 0, healthy: bool = True) -> None:
        report = WorkerReport(
            self.name, self.role, healthy, num_running, 0, 64, kv_blocks_used, 0, 0
        )
        self.on_batch(OutputBatch((), report))


class FakeProvisioner:
    def __init__(self, room: int = 8, die_at_once: bool = False):
        self.room = room  # more workers it can place
        self.die_at_once = die_at_once
        self.say_at_listen = False  # its workers report as soon as the router listens
        self.clients: list[QuietClient] = []
        self.removed: list[str] = []
        self._index = {"prefill": 1, "decode": 2}

    async def check_room(self, num_prefill: int, num_decode: int) -> None:
        if num_prefill + num_decode > self.room:
            raise ScaleError("no_room", f"room for {self.room} more workers")

    async def add(self, role: str) -> QuietClient:
        name = f"{role}-{self._index[role]}"
        self._index[role] += 1
        client = QuietClient(name, role, die_at_once=self.die_at_once)
        client.say_at_listen = self.say_at_listen
        self.clients.append(client)
        return client

    async def remove(self, name: str) -> None:
        self.removed.append(name)


def make_router(
    provisioner: FakeProvisioner, restarter=None, grace_s: float = 30.0, **config
) -> tuple[Router, dict[str, QuietClient]]:
    clients = {n: QuietClient(n, n.split("-")[0]) for n in ("prefill-0", "decode-0", "decode-1")}
    for client in clients.values():
        client.say_at_listen = True
    cfg = RouterConfig(
        "tiny", "LlamaForCausalLM", "float32", 256, 1000, 8, scale_down_grace_s=grace_s, **config
    )
    router = Router(
        cfg,
        None,  # type: ignore[arg-type]  # nothing here tokenizes
        [clients["prefill-0"]],
        [clients["decode-0"], clients["decode-1"]],
        restarter=restarter,
        restart_policy=FAST,
        provisioner=provisioner,
    )
    return router, clients


# ---- the lifecycle, one test per transition ------------------------------------------


def test_joined_moves_a_joining_worker_to_serving_only():
    life = WorkerLifecycle("d")
    assert life.phase is Phase.JOINING
    life.joined()
    assert life.phase is Phase.SERVING
    with pytest.raises(InvalidTransition, match="cannot joined when serving"):
        life.joined()


def test_drain_moves_a_serving_worker_to_draining_only():
    with pytest.raises(InvalidTransition, match="cannot drain when joining"):
        WorkerLifecycle("d").drain()
    life = WorkerLifecycle("d", Phase.SERVING)
    life.drain()
    assert life.phase is Phase.DRAINING


@pytest.mark.parametrize("phase", [Phase.JOINING, Phase.DRAINING])
def test_retire_ends_a_joining_or_draining_worker(phase):
    life = WorkerLifecycle("d", phase)
    life.retire()
    assert life.phase is Phase.RETIRED
    for step in (life.joined, life.drain, life.retire):
        with pytest.raises(InvalidTransition):
            step()


def test_a_serving_worker_is_not_retired_without_a_drain():
    with pytest.raises(InvalidTransition, match="cannot retire when serving"):
        WorkerLifecycle("d", Phase.SERVING).retire()


# ---- the router side -------------------------------------------------------------------


def test_the_policy_skips_a_draining_worker():
    req = RouteRequest(num_prompt_tokens=16, block_hashes=(), block_size=8)
    busy, draining = WorkerState("d0", num_running=5), WorkerState("d1", is_draining=True)
    for policy in ("round_robin", "least_loaded", "kv_aware"):
        for cursor in range(3):
            assert pick(policy, [busy, draining], req, cursor).name == "d0"
    with pytest.raises(NoHealthyWorker):
        pick("least_loaded", [draining], req, 0)
    # No prefill worker but a draining one: auto prefills on the decode worker.
    decision = route(
        req,
        [WorkerState("p0", is_draining=True)],
        [busy],
        policy="least_loaded",
        disaggregation="auto",
        auto_local_prefill_tokens=0,
        saturated_queue=8,
    )
    assert (decision.decode, decision.prefill) == ("d0", None)


def test_a_new_worker_is_routable_only_after_its_first_healthy_report():
    async def body():
        provisioner = FakeProvisioner()
        router, _ = make_router(provisioner)
        await router.start()
        scaling = router.scaling
        assert scaling.current() == (1, 2)
        task = asyncio.ensure_future(scaling.scale_to(2, 3))
        # Added one at a time: the prefill worker first, joined only after its report.
        await until(lambda: len(router.prefill) == 2)
        new_prefill = router.prefill[1]
        assert not new_prefill.state().is_routable and scaling.owns("prefill-1")
        assert scaling.lifecycles["prefill-1"].phase is Phase.JOINING
        provisioner.clients[0].say()
        await until(lambda: len(router.decode) == 3)
        assert new_prefill.state().is_routable and not scaling.owns("prefill-1")
        provisioner.clients[1].say()
        result = await task
        assert (result.before, result.after) == ((1, 2), (2, 3))
        assert result.added == ("prefill-1", "decode-2") and not result.retired
        assert all(v.state().is_routable for v in [*router.prefill, *router.decode])
        assert router._by_name["decode-2"] is router.decode[2]
        await router.stop()

    asyncio.run(body())


def test_the_least_loaded_worker_drains_takes_nothing_new_and_retires_once_free():
    async def body():
        provisioner = FakeProvisioner()
        router, clients = make_router(provisioner)
        await router.start()
        busy, light = router.decode
        clients["decode-0"].say(num_running=3, kv_blocks_used=9)
        clients["decode-1"].say(num_running=1, kv_blocks_used=2)
        light.expect("r1", Expected(0, 2))  # a request running there
        light.active.add("r1")
        task = asyncio.ensure_future(router.scaling.scale_to(1, 1))
        await until(lambda: light.is_draining)
        assert router.scaling.lifecycles["decode-1"].phase is Phase.DRAINING
        assert not light.state().is_routable and busy.state().is_routable
        assert router.scaling.current() == (1, 1)
        await asyncio.sleep(0.2)
        assert not task.done()  # its request runs
        light.end("r1")
        await asyncio.sleep(0.2)
        assert not task.done()  # its blocks are not yet reported free
        clients["decode-1"].say(kv_blocks_used=0)
        result = await task
        assert result.retired == ("decode-1",) and result.num_migrated == 0
        assert router.decode == [busy] and "decode-1" not in router._by_name
        assert provisioner.removed == ["decode-1"] and clients["decode-1"].is_closed
        assert not router.scaling.lifecycles
        await router.stop()

    asyncio.run(body())


def test_a_dead_worker_goes_first_and_a_death_while_draining_is_not_restarted():
    async def body():
        provisioner, restarter = FakeProvisioner(), FakeRestarter(num_failures=1)
        provisioner.say_at_listen = True
        router, clients = make_router(provisioner, restarter)
        router.recovery.policy = type(FAST)(max_attempts=1, backoff_s=0.01)
        await router.start()
        clients["decode-1"].on_lost("gone")  # its one restart fails: it stays out
        await until(lambda: "decode-1" in router.recovery.failed)
        result = await router.scaling.scale_to(1, 1)
        assert result.retired == ("decode-1",) and provisioner.removed == ["decode-1"]
        # decode-0, the less loaded of two, drains with a request running, and dies.
        await router.scaling.scale_to(1, 2)
        old = router.decode[0]
        provisioner.clients[-1].say(num_running=5, kv_blocks_used=10)
        old.active.add("r")
        old.expect("r", Expected(0, 1))
        clients["decode-0"].say(num_running=1, kv_blocks_used=1)
        task = asyncio.ensure_future(router.scaling.scale_to(1, 1))
        await until(lambda: old.is_draining)
        clients["decode-0"].on_lost("killed")
        result = await task
        assert result.retired == ("decode-0",) and restarter.calls == ["decode-1"]
        assert not router.recovery.is_restarting("decode-0") and len(router.decode) == 1
        await router.stop()

    asyncio.run(body())


def test_a_join_that_fails_is_undone():
    async def body():
        provisioner, restarter = FakeProvisioner(die_at_once=True), FakeRestarter()
        router, _ = make_router(provisioner, restarter)
        await router.start()
        with pytest.raises(ScaleError) as info:
            await router.scaling.scale_to(1, 3)
        assert info.value.kind == "failed" and "decode-2 did not join" in info.value.message
        assert provisioner.removed == ["decode-2"] and len(router.decode) == 2
        assert "decode-2" not in router._by_name and not restarter.calls
        assert not router.scaling.lifecycles
        await router.stop()

    asyncio.run(body())


def test_a_partial_scale_up_says_what_stays():
    class FailsSecond(FakeProvisioner):
        async def add(self, role: str) -> QuietClient:
            if self.clients:
                raise RuntimeError("no GPU left")
            return await super().add(role)

    async def body():
        provisioner = FailsSecond()
        provisioner.say_at_listen = True
        router, _ = make_router(provisioner)
        await router.start()
        with pytest.raises(ScaleError) as info:
            await router.scaling.scale_to(2, 3)
        counts = router.scaling.current()
        await router.stop()
        return info.value, counts

    error, counts = asyncio.run(body())
    assert error.kind == "failed" and counts == (2, 2)
    assert error.message == (
        "a new decode worker did not start: no GPU left (added prefill-1: now 2 prefill, 2 decode)"
    )


@pytest.mark.parametrize(
    ("target", "kind", "message"),
    [
        ((0, 2), "invalid", "prefill: must be an integer >= 1, got 0"),
        ((1, True), "invalid", "decode: must be an integer >= 1, got True"),
        ((3, 3), "no_room", "3 prefill + 3 decode workers is above router.scale_max_replicas (5)"),
        ((1, 4), "no_room", "room for 1 more workers"),
    ],
)
def test_refusals_name_the_reason(target, kind, message):
    async def body():
        router, _ = make_router(FakeProvisioner(room=1), scale_max_replicas=5)
        await router.start()
        with pytest.raises(ScaleError) as info:
            await router.scaling.scale_to(*target)
        await router.stop()
        return info.value

    error = asyncio.run(body())
    assert error.kind == kind and message in error.message


def test_no_scaling_while_the_router_drains():
    async def body():
        provisioner = FakeProvisioner()
        router, _ = make_router(provisioner)
        await router.start()
        await router.drain(grace_s=0)
        with pytest.raises(ScaleError) as info:
            await router.scaling.scale_to(1, 3)
        await router.stop()
        return info.value, provisioner

    error, provisioner = asyncio.run(body())
    assert (error.kind, error.message) == ("unavailable", "the router is draining")
    assert not provisioner.clients


def test_the_router_s_scaling_is_a_planner_scaler_and_the_virtual_one_counts():
    router, _ = make_router(FakeProvisioner())
    assert isinstance(router.scaling, Scaler)
    clock = [0.0]
    virtual = VirtualScaler(1, 1, max_workers=4, delay_s=5.0, clock=lambda: clock[0])
    assert isinstance(virtual, Scaler)
    assert asyncio.run(virtual.scale_to(2, 2)) == (1, 1)  # not yet
    clock[0] = 5.0
    assert virtual.current() == (2, 2) and virtual.calls == [(2, 2)]
    for bad in ((0, 1), (3, 2)):
        with pytest.raises(ValueError):
            asyncio.run(virtual.scale_to(*bad))


# ---- the admin route and `baton scale` --------------------------------------------------


def _call(url: str, method: str = "GET", body: bytes | None = None, key: str | None = ADMIN_KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def test_the_admin_route_needs_the_admin_key_and_baton_scale_drives_it(monkeypatch, capsys):
    monkeypatch.setenv("BATON_ADMIN_KEY", ADMIN_KEY)

    async def body():
        provisioner = FakeProvisioner()
        provisioner.say_at_listen = True
        router, _ = make_router(provisioner, grace_s=0.0)
        await router.start()
        server = HttpServer(router, "127.0.0.1", 0, admin_key=AdminKey.load())
        closed = HttpServer(router, "127.0.0.1", 0)  # no admin key: the routes are off
        await server.start()
        await closed.start()
        url = f"http://{server.address}/admin/scale"

        async def call(*args, **kw):
            return await asyncio.to_thread(_call, *args, **kw)

        answers = {
            "no key": await call(url, key=None),
            "wrong key": await call(url, key="x" * 24),
            "off": await call(f"http://{closed.address}/admin/scale"),
            "get": await call(url),
            "bad json": await call(url, "POST", b"{prefill: 2"),
            "zero": await call(url, "POST", b'{"prefill": 0}'),
            "a string": await call(url, "POST", b'{"decode": "2"}'),
            "empty": await call(url, "POST", b"{}"),
        }
        argv = ["scale", "--target", server.address, "--prefill", "2"]
        code = await asyncio.to_thread(baton, argv)
        answers["scale"] = await call(url, "POST", b'{"decode": 1}')
        show = await asyncio.to_thread(baton, ["scale", "--target", server.address])
        await server.stop()
        await closed.stop()
        await router.stop()
        return answers, code, show

    answers, code, show = asyncio.run(body())
    assert answers["no key"][0] == 401 and answers["wrong key"][0] == 401
    assert answers["off"][0] == 403 and "no admin key is configured" in answers["off"][1]["message"]
    assert answers["get"] == (200, {"prefill": 1, "decode": 2})
    assert answers["bad json"][0] == 400 and "not valid JSON" in answers["bad json"][1]["message"]
    assert answers["zero"][0] == 400 and answers["zero"][1]["param"] == "prefill"
    assert answers["a string"][0] == 400 and answers["a string"][1]["param"] == "decode"
    assert answers["empty"][0] == 400
    assert code == 0
    status, scaled = answers["scale"]
    assert status == 200 and scaled["before"] == {"prefill": 2, "decode": 2}
    assert scaled["after"] == {"prefill": 2, "decode": 1} and len(scaled["retired"]) == 1
    assert show == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["prefill 1 -> 2, decode 2 -> 2 (added prefill-1)", "prefill 2, decode 1"]


def test_the_status_says_draining_for_a_worker_being_removed():
    from types import SimpleNamespace

    from router.status import _state

    view = SimpleNamespace(name="d1", is_alive=True, is_draining=True, is_healthy=True, report=1)
    assert _state(view, None) == "draining"
    view.is_draining = False
    assert _state(view, None) == "serving"
