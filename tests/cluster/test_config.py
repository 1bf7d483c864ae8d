"""Cluster config: the documented example loads, every bad value names its key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import (
    ClusterConfig,
    KVCacheSection,
    config_json_schema,
    load_config,
    parse_config,
)
from cluster.config_schema import ConfigError, replaced

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_loads_with_its_values():
    config = load_config(ROOT / "configs" / "example.yaml")
    assert config.prefill.tensor_parallel == 2 and config.decode.replicas == 4
    assert config.model.dtype == "bfloat16" and config.kv_cache.gpu_memory_fraction == 0.9
    assert config.router.policy == "kv_aware" and config.kv_transfer.lease_seconds == 30.0


def test_empty_config_is_the_defaults_and_no_config_the_embedded_default():
    assert parse_config(None) == ClusterConfig()
    assert ClusterConfig().router.host == "127.0.0.1"
    # The embedded default adds only what it can afford: a modest host KV tier.
    embedded = load_config(None)
    assert embedded == replaced(ClusterConfig(), kv_cache=embedded.kv_cache)
    assert embedded.kv_cache == KVCacheSection(host_tier_gib=embedded.kv_cache.host_tier_gib)
    assert 0 < embedded.kv_cache.host_tier_gib <= 1.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prefil": {}}, "prefil: unknown key"),
        ({"router": {"portt": 1}}, "router.portt: unknown key"),
        ({"router": {"port": 70000}}, "router.port: must be <= 65535, got 70000"),
        ({"router": {"port": "50051"}}, "router.port: expected an integer"),
        ({"prefill": {"tensor_parallel": 0}}, "prefill.tensor_parallel: must be >= 1"),
        ({"prefill": {"replicas": True}}, "prefill.replicas: expected an integer"),
        ({"kv_cache": {"gpu_memory_fraction": 1.5}}, "kv_cache.gpu_memory_fraction: must be <= 1"),
        ({"kv_cache": {"gpu_memory_fraction": 0}}, "kv_cache.gpu_memory_fraction: must be > 0"),
        ({"kv_transfer": {"backend": "rdma"}}, "kv_transfer.backend: must be one of nixl, local"),
        ({"router": {"policy": None}}, "router.policy: must be one of"),
        ({"model": {"path": ""}}, "model.path: expected a non-empty string"),
        ({"model": "x"}, "model: expected a mapping"),
        ({"decode": {"replicas": 0}}, "decode.replicas: must be >= 1"),
        ({"prefill": {"replicas": 0}}, "disaggregation: never"),
        ({"router": {"restart_attempts": -1}}, "router.restart_attempts: must be >= 0"),
        ({"router": {"restart_backoff_seconds": 0}}, "router.restart_backoff_seconds: must be > 0"),
        (
            {"router": {"restart_backoff_seconds": 10, "restart_max_backoff_seconds": 5}},
            "router.restart_max_backoff_seconds .5.0. is below router.restart_backoff_seconds",
        ),
        ([1, 2], "config: expected a mapping"),
        (
            {"decode": {"speculative": {"method": "draft"}}},
            "decode.speculative: method: draft needs draft_model",
        ),
        (
            {"decode": {"speculative": {"method": "ngram", "draft_model": "/d"}}},
            "decode.speculative: draft_model: set only with method: draft .method is ngram.",
        ),
        (
            {"decode": {"speculative": {"ngram_min": 5, "ngram_max": 3}}},
            "decode.speculative: ngram_min .5. must be <= ngram_max .3.",
        ),
        ({"decode": {"speculative": {"method": "beam"}}}, "decode.speculative.method: must be"),
        ({"decode": {"speculative": {"num_tokens": 17}}}, "decode.speculative.num_tokens: must"),
        (
            {"decode": {"tensor_parallel": 2, "speculative": {"method": "ngram"}}},
            "decode.speculative.method: speculative decoding needs single-rank decode replicas; "
            "decode has tensor_parallel=2, pipeline_parallel=1",
        ),
        (
            {"decode": {"pipeline_parallel": 2, "speculative": {"method": "ngram"}}},
            "decode has tensor_parallel=1, pipeline_parallel=2",
        ),
        ({"prefill": {"speculative": {"method": "ngram"}}}, "prefill.speculative: unknown key"),
    ],
)
def test_bad_values_name_the_key_path(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_config(data)


def test_zero_prefill_replicas_allowed_when_aggregated():
    config = parse_config({"prefill": {"replicas": 0}, "router": {"disaggregation": "never"}})
    assert config.prefill.replicas == 0


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad.write_text("router:\n  port: -1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: router\.port: must be >= 0"):
        load_config(bad)


def test_json_schema_covers_every_field_with_docs_and_defaults():
    schema = config_json_schema()
    router = schema["properties"]["router"]
    assert router["additionalProperties"] is False
    port = router["properties"]["port"]
    assert port == {
        "type": "integer",
        "description": port["description"],
        "default": 50051,
        "minimum": 0,
        "maximum": 65535,
    }
    assert port["description"]
    assert schema["properties"]["model"]["properties"]["path"]["type"] == ["string", "null"]
    policy = router["properties"]["policy"]
    assert policy["enum"] == ["round_robin", "least_loaded", "kv_aware"]

    def walk(node):
        for prop in node["properties"].values():
            assert prop["description"], prop
            if "properties" in prop:
                walk(prop)

    walk(schema)


def test_config_docs_are_fresh():
    from cluster.config_docs import render

    assert (ROOT / "docs" / "config.md").read_text() == render(), (
        "docs/config.md is stale: python -m cluster.config_docs > docs/config.md"
    )


def test_local_ranks_share_the_cores_the_router_does_not_keep():
    from cluster.bringup import local_rank_threads

    assert ClusterConfig().router.reserved_cpus == 1
    assert local_rank_threads(2, 1, 1) == 1  # one worker on 2 cores: one for the router
    assert local_rank_threads(2, 0, 1) == 2  # reserved_cpus: 0 gives it both
    assert local_rank_threads(16, 1, 2) == 7
    assert local_rank_threads(2, 1, 4) == 1  # never fewer than one
    with pytest.raises(ConfigError, match="reserved_cpus"):
        parse_config({"router": {"reserved_cpus": -1}})
