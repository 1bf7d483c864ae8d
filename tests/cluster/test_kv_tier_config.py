"""The KV tiers' cluster keys (kv_cache.host_tier_gib, disk_tier_path, disk_tier_gib,
peer_sharing): they reach the engine, a worker gets its own disk directory, and what the
tiers cannot do yet is refused at load in the YAML's key names."""

from __future__ import annotations

import os

import pytest

from cluster.bringup import router_config
from cluster.config import engine_config, load_config, parse_config
from cluster.config_schema import ConfigError
from router.config import RouterConfig
from router.policy import KVWeights
from workers.engine.config import EngineConfig
from workers.protocol.wire import WorkerInfo
from workers.serving.worker_spec import WorkerSpec


def test_the_tier_keys_reach_every_workers_engine(tmp_path):
    config = parse_config(
        {
            "kv_cache": {
                "host_tier_gib": 2,
                "disk_tier_path": str(tmp_path / "kv"),
                "disk_tier_gib": 8,
                "peer_sharing": True,
            }
        }
    )
    for pool in (config.prefill, config.decode):
        engine = engine_config(config, pool, model="/m")
        assert (engine.kv_host_tier_gib, engine.kv_disk_tier_gib) == (2.0, 8.0)
        assert engine.kv_disk_tier_path == str(tmp_path / "kv")
        assert engine.kv_peer_sharing is True
    # Made at load when missing: the workers write under it.
    assert (tmp_path / "kv").is_dir()


def test_each_worker_has_its_own_disk_directory_under_the_path_by_name():
    engine = EngineConfig(model="/m", kv_disk_tier_path="/data/kv", kv_host_tier_gib=1.0)
    specs = [WorkerSpec(name, "decode", "tiny", engine) for name in ("decode-0", "decode-1")]
    paths = [spec.engine_settings().kv_disk_tier_path for spec in specs]
    assert paths == ["/data/kv/decode-0", "/data/kv/decode-1"]
    # A restarted worker is built from a spec of the same name: the same directory.
    again = WorkerSpec.from_bytes(specs[0].to_bytes())
    assert again.engine_settings().kv_disk_tier_path == "/data/kv/decode-0"
    settings = specs[0].engine_settings()
    assert settings.detokenize is False and settings.kv_host_tier_gib == 1.0
    off = WorkerSpec("prefill-0", "prefill", "tiny", EngineConfig(model="/m"))
    assert off.engine_settings().kv_disk_tier_path is None


@pytest.mark.parametrize(
    "pool", [{"prefill": {"tensor_parallel": 2}}, {"decode": {"pipeline_parallel": 2}}]
)
@pytest.mark.parametrize(
    "tiers", [{"host_tier_gib": 1}, {"peer_sharing": True}, {"disk_tier_path": "DISK"}]
)
def test_a_tier_on_a_multi_rank_pool_is_refused_in_yaml_keys(tmp_path, pool, tiers):
    tiers = {k: str(tmp_path) if v == "DISK" else v for k, v in tiers.items()}
    with pytest.raises(ConfigError) as err:
        parse_config({"kv_cache": tiers, **pool})
    role = next(iter(pool))
    message = str(err.value)
    assert "kv_cache" in message and "single-rank" in message and role in message
    # Without a tier the same pools load.
    assert parse_config(pool)


@pytest.mark.parametrize("tiers", [{"host_tier_gib": 1}, {"peer_sharing": True}])
def test_a_tier_without_prefix_caching_is_refused(tiers):
    with pytest.raises(ConfigError, match=r"kv_cache: the KV tiers .* need enable_prefix_caching"):
        parse_config({"kv_cache": {**tiers, "enable_prefix_caching": False}})
    assert parse_config({"kv_cache": {"enable_prefix_caching": False}})


def test_a_tier_is_allowed_when_the_multi_rank_pool_has_no_replicas():
    config = parse_config(
        {
            "kv_cache": {"host_tier_gib": 1},
            "prefill": {"replicas": 0, "tensor_parallel": 2},
            "router": {"disaggregation": "never"},
        }
    )
    assert config.kv_cache.host_tier_gib == 1.0


def test_a_relative_disk_tier_path_is_made_absolute_where_the_config_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = parse_config({"kv_cache": {"disk_tier_path": "kv/cache"}})
    assert config.kv_cache.disk_tier_path == str(tmp_path.resolve() / "kv" / "cache")
    assert engine_config(config, config.decode, model="/m").kv_disk_tier_path == str(
        tmp_path.resolve() / "kv" / "cache"
    )


def test_a_disk_tier_path_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ConfigError, match=r"kv_cache: disk_tier_path: .*file.* not a directory"):
        parse_config({"kv_cache": {"disk_tier_path": str(file)}})
    with pytest.raises(ConfigError, match=r"kv_cache: disk_tier_path: cannot create"):
        parse_config({"kv_cache": {"disk_tier_path": str(file / "below")}})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_disk_tier_path_that_is_not_writable_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError, match=r"kv_cache: disk_tier_path: .*not writable"):
            parse_config({"kv_cache": {"disk_tier_path": str(locked)}})
        with pytest.raises(ConfigError, match=r"kv_cache: disk_tier_path: cannot create"):
            parse_config({"kv_cache": {"disk_tier_path": str(locked / "kv")}})
    finally:
        locked.chmod(0o700)


def test_the_embedded_default_turns_on_a_host_tier_only():
    kv = load_config(None).kv_cache
    assert kv.host_tier_gib > 0
    assert kv.disk_tier_path is None and kv.peer_sharing is False


def test_the_routers_tier_weights_default_to_the_policys_and_reach_it():
    config = parse_config({"router": {"kv_host_tier_weight": 0.2, "kv_disk_tier_weight": 0.7}})
    assert (config.router.kv_host_tier_weight, config.router.kv_disk_tier_weight) == (0.2, 0.7)
    default = parse_config(None).router
    weights = KVWeights()
    assert default.kv_host_tier_weight == weights.host_tier_weight
    assert default.kv_disk_tier_weight == weights.disk_tier_weight
    with pytest.raises(ConfigError, match=r"router\.kv_disk_tier_weight: must be >= 0"):
        parse_config({"router": {"kv_disk_tier_weight": -1}})
    assert default.kv_receive_weight == weights.receive_weight
    assert parse_config({"router": {"kv_receive_weight": 0}}).router.kv_receive_weight == 0
    with pytest.raises(ConfigError, match=r"router\.kv_receive_weight: must be >= 0"):
        parse_config({"router": {"kv_receive_weight": -0.1}})


def test_the_peer_pull_keys_default_to_the_routers_and_are_bounded():
    config = parse_config({"router": {"peer_min_blocks": 8, "peer_export_timeout_seconds": 0.5}})
    assert (config.router.peer_min_blocks, config.router.peer_export_timeout_seconds) == (8, 0.5)
    default, router = parse_config(None).router, RouterConfig("m", "a", "float32", 64, 100, 16)
    assert default.peer_min_blocks == router.peer_min_blocks
    assert default.peer_export_timeout_seconds == router.peer_export_timeout_s
    with pytest.raises(ConfigError, match=r"router\.peer_min_blocks: must be >= 1, got 0"):
        parse_config({"router": {"peer_min_blocks": 0}})
    with pytest.raises(ConfigError, match=r"router\.peer_export_timeout_seconds: must be > 0"):
        parse_config({"router": {"peer_export_timeout_seconds": 0}})
    with pytest.raises(ConfigError, match=r"router\.peer_min_blocks"):
        parse_config({"router": {"peer_min_blocks": "four"}})


def test_bring_up_gives_the_router_its_peer_and_routing_keys():
    config = parse_config(
        {
            "kv_cache": {"peer_sharing": True},
            "router": {
                "peer_min_blocks": 6,
                "peer_export_timeout_seconds": 1.5,
                "kv_receive_weight": 0.25,
                "kv_host_tier_weight": 0.05,
            },
        }
    )
    info = WorkerInfo("decode-0", "LlamaForCausalLM", "float32", 512, 1000, 16, 64, "cpu")
    router = router_config(config, "tiny", info)
    assert router.peer_sharing is True and router.peer_min_blocks == 6
    assert router.peer_export_timeout_s == 1.5
    assert (router.kv_weights.receive_weight, router.kv_weights.host_tier_weight) == (0.25, 0.05)
    assert (router.model_name, router.block_size, router.max_model_len) == ("tiny", 16, 512)
