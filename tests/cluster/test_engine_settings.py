"""Engine settings are declared once (workers/engine/config.py): the cluster config's fields,
the worker spec and the engine all take them from ``EngineConfig``."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from pydantic.fields import FieldInfo

from cluster.config import (
    ClusterConfig,
    KVCacheSection,
    ModelSection,
    PoolSection,
    SpeculativeSection,
    engine_config,
    parse_config,
)
from cluster.config_schema import ConfigError, bounds, declared_name, subsection
from workers.engine.config import EngineConfig
from workers.serving.worker_spec import WorkerSpec

# The engine's fields that the cluster config does not set, and why.
NOT_IN_CLUSTER_CONFIG = {
    "model": "the directory is resolved per worker (model.path, or a model made on first use)",
    "seed": "workers keep the engine's default",
    "detokenize": "workers never detokenize: the router does",
}
# Section path -> its class; ``decode.speculative`` is the decode pool's own sub-section.
SECTIONS = {
    "model": ModelSection,
    "prefill": PoolSection,
    "kv_cache": KVCacheSection,
    "decode.speculative": SpeculativeSection,
}
ENGINE = {f.name: f for f in dataclasses.fields(EngineConfig)}


def config_fields() -> dict[str, tuple[str, FieldInfo]]:
    """engine setting -> (its YAML key, the section field that sets it)."""
    found: dict[str, tuple[str, FieldInfo]] = {}
    for top, cls in SECTIONS.items():
        for key, f in cls.model_fields.items():
            if (name := declared_name(f, "engine")) is not None:
                assert name not in found, f"{key} set in two places"
                found[name] = (f"{top}.{key}", f)
    return found


def test_every_engine_setting_is_in_the_cluster_config_or_said_why_not():
    assert set(config_fields()) == set(ENGINE) - set(NOT_IN_CLUSTER_CONFIG)
    # No other section sets an engine setting.
    for name, top in ClusterConfig.model_fields.items():
        if name not in (*SECTIONS, "decode"):
            cls = subsection(top)
            assert cls is not None, name
            assert not any(declared_name(f, "engine") for f in cls.model_fields.values()), name


@pytest.mark.parametrize("name", sorted(set(ENGINE) - set(NOT_IN_CLUSTER_CONFIG)))
def test_the_config_field_has_the_engines_default_doc_bounds_and_type(name):
    key, field = config_fields()[name]
    setting = ENGINE[name]
    assert field.default == setting.default, key
    assert set(setting.metadata) <= {"doc", "ge", "le", "gt", "lt"}, name
    assert field.description == setting.metadata["doc"], key
    declared = {k: v for k, v in setting.metadata.items() if k != "doc" and v is not None}
    assert bounds(field) == declared, key
    assert setting.metadata["doc"], name
    config_type = field.annotation
    engine_type = typing.get_type_hints(EngineConfig)[name]
    if name == "device":  # narrowed at the cluster edge: Ray assigns each rank its GPU
        assert engine_type is str and typing.get_args(config_type) == ("auto", "cpu", "cuda")
    else:
        assert config_type == engine_type, key


def test_the_worker_spec_carries_the_engine_config_without_copies():
    hints = typing.get_type_hints(WorkerSpec)
    assert hints["engine"] is EngineConfig
    assert not set(hints) & (set(ENGINE) - {"model"}), "an engine setting repeated in WorkerSpec"
    assert "model" not in hints
    spec = WorkerSpec("decode-0", "decode", "tiny", EngineConfig(model="/m", num_kv_blocks=7))
    assert WorkerSpec.from_bytes(spec.to_bytes()) == spec


def test_the_default_config_gives_the_engines_defaults():
    config = ClusterConfig()
    for pool in (config.prefill, config.decode):
        assert engine_config(config, pool, model="/m") == EngineConfig(model="/m")


def test_engine_config_maps_the_yaml_keys_and_takes_the_pools_own():
    config = parse_config(
        {
            "model": {"dtype": "float16", "max_model_len": 512},
            "kv_cache": {"block_size": 32, "num_blocks": 9, "cpu_memory_gib": 1.5},
            "prefill": {"max_num_batched_tokens": 4096, "max_num_seqs": 8},
            # Below max_num_seqs: the config raises the budget to it, where the engine refuses.
            "decode": {"max_num_batched_tokens": 16, "max_num_seqs": 128},
        }
    )
    prefill = engine_config(config, config.prefill, model="/m", device="cpu")
    assert prefill == EngineConfig(
        model="/m",
        dtype="float16",
        device="cpu",
        max_model_len=512,
        block_size=32,
        num_kv_blocks=9,
        kv_cache_memory_gib=1.5,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
    )
    decode = engine_config(config, config.decode, model="/m", device="cuda")
    assert (decode.max_num_seqs, decode.max_num_batched_tokens, decode.device) == (128, 128, "cuda")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="/m", max_num_batched_tokens=16, max_num_seqs=128)


def test_only_the_decode_pool_speculates():
    config = parse_config(
        {
            "decode": {
                "speculative": {
                    "method": "ngram",
                    "num_tokens": 3,
                    "ngram_max": 5,
                    "ngram_min": 1,
                    "max_batch_size": 2,
                }
            }
        }
    )
    decode = engine_config(config, config.decode, model="/m")
    assert decode == EngineConfig(
        model="/m",
        speculative_method="ngram",
        speculative_num_tokens=3,
        speculative_ngram_max=5,
        speculative_ngram_min=1,
        speculative_max_batch_size=2,
    )
    # Prefill samples one token per request: it has no speculative section at all.
    assert engine_config(config, config.prefill, model="/m") == EngineConfig(model="/m")
    with pytest.raises(ConfigError, match=r"^prefill\.speculative: unknown key"):
        parse_config({"prefill": {"speculative": {"method": "ngram"}}})


def _violations() -> list[tuple[str, str, object]]:
    """(engine setting, its YAML key, a value beyond one of its declared bounds)."""
    cases = []
    for name, (key, field) in sorted(config_fields().items()):
        meta = bounds(field)
        for bound, beyond in (("ge", -1), ("gt", 0), ("le", 1)):
            if meta.get(bound) is not None:
                cases.append((name, key, meta[bound] + beyond))
    # A Literal's choices too.
    return [
        *cases,
        ("dtype", "model.dtype", "float8"),
        ("speculative_method", "decode.speculative.method", "beam"),
    ]


def _nested(key: str, value: object) -> dict:
    """``{"a": {"b": value}}`` from the key path ``a.b``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value  # type: ignore[return-value]


@pytest.mark.parametrize(("name", "key", "value"), _violations())
def test_yaml_edge_and_engine_refuse_a_bound_alike(name, key, value):
    """One declared bound, checked at both edges, worded alike (the YAML one names the key)."""
    with pytest.raises(ConfigError) as yaml_error:
        parse_config(_nested(key, value))
    with pytest.raises(ValueError) as engine_error:
        EngineConfig(model="/m", **{name: value})
    assert str(yaml_error.value).startswith(f"{key}: must be ")
    assert str(yaml_error.value).removeprefix(key) == str(engine_error.value).removeprefix(name)
