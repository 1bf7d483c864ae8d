"""values.schema.json (no helm needed): it accepts the chart's values and every example,
refuses bad values with the offending key, and its ``config`` part is exactly the cluster
config's schema, generated from cluster/config.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.helm_schema import SCHEMA_PATH, config_values_schema, render

from .chart import CHART, EXAMPLES, load_yaml, merge_values

SCHEMA = json.loads(SCHEMA_PATH.read_text())
DEFAULTS = load_yaml(CHART / "values.yaml")


def errors(values: dict) -> list[str]:
    """Each schema violation as 'dotted.path: message' (helm reports the same way)."""
    validator = jsonschema.Draft7Validator(SCHEMA)
    return [
        ".".join(str(p) for p in e.absolute_path) + ": " + e.message
        for e in validator.iter_errors(values)
    ]


def test_the_schema_is_valid_draft7_and_accepts_the_default_values():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert errors(DEFAULTS) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_values_file_is_valid(example):
    assert errors(merge_values(DEFAULTS, load_yaml(example))) == []


def test_there_are_examples():
    assert len(EXAMPLES) >= 3


BAD = [
    ({"config": {"decode": {"replicas": -1}}}, "config.decode.replicas"),
    ({"config": {"prefill": {"tensor_paralel": 2}}}, "config.prefill"),  # a typo
    ({"config": {"router": {"policy": "random"}}}, "config.router.policy"),
    ({"config": {"kv_cache": {"gpu_memory_fraction": 1.5}}}, "config.kv_cache.gpu_memory_fraction"),
    ({"config": {"model": {"max_model_len": "8k"}}}, "config.model.max_model_len"),
    (
        {"config": {"decode": {"speculative": {"method": "medusa"}}}},
        "config.decode.speculative.method",
    ),
    ({"config": {"prefill": {"speculative": {"method": "ngram"}}}}, "config.prefill"),
    ({"workers": {"decode": {"gpusPerPod": 0}}}, "workers.decode.gpusPerPod"),
    ({"shm": {"sizeLimit": 16}}, "shm.sizeLimit"),
    ({"shm": {"sizeLimit": "16 GB"}}, "shm.sizeLimit"),
    ({"service": {"port": "grpc"}}, "service.port"),
    ({"service": {"type": "Ingress"}}, "service.type"),
    ({"rdma": {"count": 0}}, "rdma.count"),
    ({"rdma": {"enabled": "yes"}}, "rdma.enabled"),
    ({"imagePullSecrets": "regcred"}, "imagePullSecrets"),
    ({"probes": {"startup": {"failureThreshold": -3}}}, "probes.startup.failureThreshold"),
    ({"replicas": 2}, ": Additional properties"),  # not a value of this chart
]


@pytest.mark.parametrize(("override", "where"), BAD, ids=[w for _, w in BAD])
def test_bad_values_are_refused_naming_the_key(override, where):
    found = errors(merge_values(DEFAULTS, override))
    assert found, f"{override} was accepted"
    assert any(e.startswith(where) or where in e for e in found), found


def test_the_config_part_is_the_cluster_configs_schema():
    assert SCHEMA["properties"]["config"] == config_values_schema()


def test_the_schema_file_is_what_the_generator_writes():
    """Fails when cluster/config.py changed and `python -m cluster.helm_schema` was not run."""
    assert SCHEMA_PATH.read_text() == render(json.loads(SCHEMA_PATH.read_text()))
