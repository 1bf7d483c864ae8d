"""``kv_transfer.layerwise: on``: the prefill worker streams every prompt of at least
``layerwise_min_tokens`` tokens, whatever its measured numbers say (a CPU test or a
benchmark streams for sure); the YAML edge takes the setting, bare ``on``/``off`` too."""

from __future__ import annotations

import pytest
import yaml

from cluster.config import parse_config, transfer_config
from cluster.config_schema import ConfigError
from kvtransfer import KVTransferConfig
from workers.serving.layerwise_stats import LayerwiseStats


def stats(**kw) -> LayerwiseStats:
    args = dict(num_layers=8, block_size=16, block_layer_bytes=65536, chunk_tokens=512,
                max_prompt_tokens=1023)  # fmt: skip
    return LayerwiseStats(**{**args, **kw})


def test_forced_streams_from_the_configured_threshold_without_numbers():
    s = stats(forced_min_tokens=100)
    assert s.plan(4096) is None  # no number measured yet
    assert s.min_tokens() == 100  # ... and the report says 100 all the same
    assert s.group_size(4096) == 1  # one layer per write: layer-wise for sure
    assert stats().min_tokens() == 0 and stats().group_size(4096) == 8  # auto: whole
    assert stats(forced_min_tokens=5000).min_tokens() == 1023  # capped by the context


def test_forced_keeps_the_plans_groups_when_it_predicts_a_gain():
    s = stats(forced_min_tokens=64)
    s.layer_s_per_token = 2e-6  # 1 ms per layer of a 512-token chunk
    s.observe_link(1_000_000, 0.002)
    s.observe_link(100_000_000, 0.101)  # 1 GB/s, 1 ms per transfer
    plan = s.plan(1000)
    assert plan is not None and plan.group_size is not None
    assert s.group_size(1000) == plan.group_size
    assert s.plan(64).group_size is None  # too short for a gain: forced, one layer each
    assert s.group_size(64) == 1
    assert s.min_tokens() == 64  # the configured threshold, not the plan's


def load(text: str):
    return parse_config(yaml.safe_load(text))


@pytest.mark.parametrize(
    ("word", "mode"), [("on", "on"), ("off", "off"), ("auto", "auto"), ('"on"', "on")]
)
def test_the_yaml_words_including_yaml_1_1_booleans(word, mode):
    config = load(f"kv_transfer:\n  layerwise: {word}\n  layerwise_min_tokens: 64\n")
    transfer = transfer_config(config)
    assert config.kv_transfer.layerwise == transfer.layerwise == mode
    assert transfer.layerwise_min_tokens == 64


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match=r"kv_transfer\.layerwise: must be one of auto, on, off"):
        load("kv_transfer:\n  layerwise: sometimes\n")
    with pytest.raises(ConfigError, match=r"kv_transfer\.layerwise_min_tokens: must be >= 1"):
        load("kv_transfer:\n  layerwise: on\n  layerwise_min_tokens: 0\n")
    with pytest.raises(ValueError, match="layerwise_min_tokens must be >= 1"):
        KVTransferConfig(layerwise="on", layerwise_min_tokens=0)
    with pytest.raises(ValueError, match=r"kv_transfer\.layerwise must be one of"):
        KVTransferConfig(layerwise="always")
    assert transfer_config(load("")).layerwise == "off"  # the default
    assert transfer_config(load("")).layerwise_min_tokens == 512
