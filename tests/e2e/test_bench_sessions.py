"""``baton bench --dataset multi-turn`` against two aggregated workers: the sessions spread
over both (the router decides each turn's worker, ``kv_aware``), every turn completes, and a
turn that lands where its session's previous turn ran finds that turn's prompt cached."""

from __future__ import annotations

import json

import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)

from cluster.cli import main as baton
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster


@pytest.mark.slow
def test_multi_turn_sessions_spread_over_two_workers(tiny_model_dir, tmp_path):
    config = cluster_config(tiny_model_dir, disaggregation="never")
    config["prefill"]["replicas"] = 0
    config["decode"]["replicas"] = 2
    served = start_cluster(config, tmp_path)
    try:
        out = tmp_path / "result.json"
        code = baton([
            "bench", "--target", served.address, "--dataset", "multi-turn",
            "--num-sessions", "6", "--num-turns", "3", "--system-prompt-len", "32",
            "--input-len", "24", "--output-len", "8", "--think-time", "0.1",
            "--ignore-eos", "--result-json", str(out),
        ])  # fmt: skip
        assert code == 0
    finally:
        assert stop_cluster(served) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 18 and run["failed"] == 0
    assert set(run["multi_turn"]["requests_per_worker"]) == {"decode-0", "decode-1"}
    records = run["requests"]
    stayed = [
        r
        for r, before in zip(records[1:], records, strict=False)
        if r["turn"] and r["decode_worker"] == before["decode_worker"]
    ]
    assert stayed  # kv_aware weighs the cached history (it may still move a session)
    for r in stayed:
        previous_prompt = r["prompt_len"] - 24 - 8  # this turn's message, the last reply
        assert r["cached_prompt_tokens"] >= previous_prompt // 8 * 8, r
