"""``decode.attention: data_parallel`` in the cluster config and at bring-up: accepted with
``expert_parallel`` ranks per group, refused naming the key where it cannot apply; each
replica becomes a group of one-rank decode workers whose specs say their group and rank.
"""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, engine_config, parse_config
from cluster.replicas import dp_group_specs
from workers.serving.worker_spec import WorkerSpec


def _decode(**decode) -> dict:
    return {"decode": {"attention": "data_parallel", "expert_parallel": 2, **decode}}


def test_a_data_parallel_decode_pool_is_accepted_with_its_group_size():
    config = parse_config(_decode(replicas=2, expert_dispatch="alltoall"))
    assert config.decode.data_parallel == 2
    assert parse_config({}).decode.data_parallel == 1  # tensor_parallel attention: default
    engine = engine_config(config, config.decode, model="m", device="cpu")
    assert engine.expert_parallel == 2 and engine.expert_dispatch == "alltoall"


@pytest.mark.parametrize(
    ("decode", "match"),
    [
        ({"expert_parallel": 1}, "needs decode.expert_parallel >= 2"),
        ({"tensor_parallel": 2}, "set decode.tensor_parallel and decode.pipeline_parallel"),
        ({"pipeline_parallel": 2}, "set decode.tensor_parallel and decode.pipeline_parallel"),
        ({"speculative": {"method": "ngram"}}, "speculative decoding is not supported"),
        ({"expert_rebalance_steps": 8}, "expert rebalancer is not built"),
        ({"attention": "sideways"}, "decode.attention: must be one of"),
    ],
)
def test_data_parallel_is_refused_naming_the_key(decode, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(_decode(**decode))


def test_prefill_has_no_attention_key():
    with pytest.raises(ConfigError, match=r"prefill\.attention"):
        parse_config({"prefill": {"attention": "data_parallel"}})


def test_a_group_is_one_worker_per_rank_named_for_the_router():
    spec = WorkerSpec("decode-0", "decode", "tiny", engine_config(
        parse_config(_decode()), parse_config(_decode()).decode, model="m", device="cpu"
    ), data_parallel=2)  # fmt: skip
    group1 = dp_group_specs(spec, "decode", 1)
    assert [(s.name, s.dp_rank, s.dp_group) for s in group1] == [
        ("decode-2", 0, "decode-g1"),
        ("decode-3", 1, "decode-g1"),
    ]
    assert all(s.num_ranks == 1 for s in group1)  # each its own one-rank worker
    assert WorkerSpec.from_bytes(group1[1].to_bytes()) == group1[1]  # msgpack round trip


def test_the_planner_is_refused_with_a_data_parallel_decode_pool():
    with pytest.raises(ConfigError, match=r"planner\.enabled: live scaling is not built"):
        parse_config({**_decode(), "planner": {"enabled": True}})
