"""The KV hand-off's settings are declared once (``kvtransfer.KVTransferConfig``): the
cluster config's ``kv_transfer`` section and the worker spec take them from there."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from pydantic.fields import FieldInfo

from cluster.config import ClusterConfig, KVTransferSection, parse_config, transfer_config
from cluster.config_schema import ConfigError, bounds, declared_name
from kvtransfer import KVTransferConfig
from workers.engine.config import EngineConfig
from workers.serving.worker_spec import WorkerSpec

TRANSFER = {f.name: f for f in dataclasses.fields(KVTransferConfig)}
# KVTransferConfig's fields that the YAML does not expose: the connector's internal tuning.
INTERNAL = {
    "handshake_timeout_s",
    "idle_poll_s",
    "active_poll_s",
    "lease_poll_s",
    "progress_delay_us",
}


def section_fields() -> dict[str, FieldInfo]:
    """KVTransferConfig field -> the ``kv_transfer`` section field that sets it."""
    found: dict[str, FieldInfo] = {}
    for f in KVTransferSection.model_fields.values():
        name = declared_name(f, "transfer")  # every field of the section sets one
        assert name is not None
        assert name not in found, f"{name} set by two keys"
        found[name] = f
    return found


def test_every_exposed_setting_is_set_by_exactly_one_yaml_key():
    assert set(section_fields()) == set(TRANSFER) - INTERNAL
    # The internal ones carry no YAML doc: nothing renders them as options by mistake.
    assert all("doc" not in TRANSFER[name].metadata for name in INTERNAL)


@pytest.mark.parametrize("name", sorted(set(TRANSFER) - INTERNAL))
def test_the_yaml_key_has_the_declared_default_doc_and_bounds(name):
    field, declared = section_fields()[name], TRANSFER[name]
    assert field.default == declared.default
    assert set(declared.metadata) <= {"doc", "ge", "le", "gt", "lt"}, name
    assert field.description == declared.metadata["doc"]
    assert bounds(field) == {
        k: v for k, v in declared.metadata.items() if k != "doc" and v is not None
    }
    assert declared.metadata["doc"]


def test_transfer_config_maps_the_yaml_keys():
    assert transfer_config(ClusterConfig()) == KVTransferConfig()
    config = parse_config(
        {
            "kv_transfer": {
                "backend": "local",
                "direction": "push",
                "lease_seconds": 12.5,
                "timeout_seconds": 2.0,
                "on_failure": "fail",
            }
        }
    )
    assert transfer_config(config) == KVTransferConfig(
        backend="local",
        direction="push",
        lease_seconds=12.5,
        transfer_timeout_s=2.0,
        on_failure="fail",
    )


def test_the_worker_spec_carries_the_transfer_config_without_copies():
    hints = typing.get_type_hints(WorkerSpec)
    assert hints["kv_transfer"] is KVTransferConfig
    repeated = {n for n in hints for name in TRANSFER if n in (name, f"kv_{name}")}
    assert not repeated, f"hand-off settings repeated in WorkerSpec: {repeated}"
    spec = WorkerSpec(
        "prefill-0",
        "prefill",
        "tiny",
        EngineConfig(model="/m"),
        kv_transfer=KVTransferConfig(backend="local", lease_seconds=20.0, on_failure="fail"),
    )
    assert WorkerSpec.from_bytes(spec.to_bytes()) == spec


def test_a_transfer_that_would_outlive_its_lease_is_refused_at_load_time():
    with pytest.raises(ConfigError, match=r"^kv_transfer: timeout_seconds \(10.0\) must be below"):
        parse_config({"kv_transfer": {"lease_seconds": 5}})
    with pytest.raises(ValueError, match="must be below lease_seconds"):
        KVTransferConfig(lease_seconds=5, transfer_timeout_s=10)


@pytest.mark.parametrize(
    ("key", "name", "value"),
    [("backend", "backend", "tcp"), ("on_failure", "on_failure", "retry")],
)
def test_yaml_edge_and_transfer_config_refuse_a_bad_choice(key, name, value):
    with pytest.raises(ConfigError, match=f"kv_transfer.{key}"):
        parse_config({"kv_transfer": {key: value}})
    with pytest.raises(ValueError, match=f"kv_transfer.{name} must be one of"):
        KVTransferConfig(**{name: value})
