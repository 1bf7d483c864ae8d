"""RayProvisioner (cluster/scaling.py) without Ray: the Ray steps are test_restart's fakes.

What must hold: a new replica gets a name never used in the run, the pool's spec and
bundle, is introduced to every replica of the other pool and registered (shutdown stops
it); a failed one leaves nothing registered; a removed one is stopped and forgotten; the
room check names what is short. The real steps run in tests/e2e/test_scaling_cluster.py.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster import scaling
from cluster.config import parse_config
from cluster.config_schema import ConfigError
from cluster.restart import RayRestarter
from router.scaling import ScaleError
from tests.cluster.test_restart import INFO, FakeRay, registry


def provisioner(replicas) -> scaling.RayProvisioner:
    restarter = RayRestarter(replicas, listener=None, reference=INFO)  # type: ignore[arg-type]
    templates = {role: (replicas[f"{role}-0"].spec, {"CPU": 1.0}) for role in ("prefill", "decode")}
    return scaling.RayProvisioner(restarter, replicas, templates)


def test_a_new_replica_is_placed_introduced_and_registered_then_removed(monkeypatch):
    fake, replicas = FakeRay(monkeypatch), registry()
    stopped = []
    monkeypatch.setattr(
        scaling, "stop_replicas", lambda rs: stopped.extend(r.spec.name for r in rs)
    )
    ray_provisioner = provisioner(replicas)

    async def body():
        prefill = await ray_provisioner.add("prefill")
        decode = await ray_provisioner.add("decode")
        await ray_provisioner.remove("prefill-1")
        await ray_provisioner.remove("prefill-1")  # idempotent
        return prefill, decode

    prefill, decode = asyncio.run(body())
    assert (prefill.name, prefill.role, decode.name) == ("prefill-2", "prefill", "decode-1")
    assert fake.log == [
        ("place", "prefill-2-0"),
        ("introduce", "prefill-2: [('decode-0', 'prefill-2')]"),
        ("place", "decode-1-0"),
        (
            "introduce",
            "decode-1: [('decode-1', 'prefill-0'), ('decode-1', 'prefill-1'), "
            "('decode-1', 'prefill-2')]",
        ),
    ]
    assert replicas["prefill-2"].spec.name == "prefill-2" and replicas["decode-1"].ranks
    assert stopped == ["prefill-1"] and set(replicas) == {
        "prefill-0",
        "prefill-2",
        "decode-0",
        "decode-1",
    }


def test_a_replica_that_fails_to_start_is_not_registered(monkeypatch):
    FakeRay(monkeypatch, fail_start=True)
    replicas = registry()
    with pytest.raises(RuntimeError, match="rank 1 failed to start"):
        asyncio.run(provisioner(replicas).add("decode"))
    assert set(replicas) == {"prefill-0", "prefill-1", "decode-0"}


def test_the_room_check_names_what_is_short(monkeypatch):
    monkeypatch.setattr(scaling.ray, "available_resources", lambda: {"CPU": 2.0})
    ray_provisioner = provisioner(registry())
    asyncio.run(ray_provisioner.check_room(1, 1))
    with pytest.raises(ScaleError) as info:
        asyncio.run(ray_provisioner.check_room(2, 1))
    assert info.value.kind == "no_room"
    assert info.value.message == (
        "the cluster has no room for 2 more prefill and 1 more decode workers: they need "
        "{'CPU': 3.0}, free: {'CPU': 2.0}"
    )


def test_the_scaling_keys_are_checked_at_load():
    config = parse_config({"router": {"scale_max_replicas": 4, "scale_down_grace_seconds": 5}})
    assert (config.router.scale_max_replicas, config.router.scale_down_grace_seconds) == (4, 5)
    with pytest.raises(ConfigError, match=r"router.scale_max_replicas \(1\) is below .* \(2\)"):
        parse_config({"router": {"scale_max_replicas": 1}})
    with pytest.raises(ConfigError, match=r"router\.scale_down_grace_seconds: must be >= 0"):
        parse_config({"router": {"scale_down_grace_seconds": -1}})
