"""``baton bench`` against a running tiny cluster: the result's counts match the requests
sent, its percentiles and goodput are those of the per-request records it writes, the
shared-prefix workload hits the prefix cache, a trace's requests go no earlier than their
timestamps, and the charts are written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.cli import main as baton
from cluster.loadgen.metrics import Slo, summarize
from cluster.loadgen.multiturn import multi_turn_workload
from cluster.loadgen.runner import RequestRecord

PNG = b"\x89PNG\r\n\x1a\n"


def bench(cluster, tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    code = baton(["bench", "--target", cluster.address, "--result-json", str(out), *args])
    assert code == 0
    return json.loads(out.read_text())


def test_random_workload_at_two_rates(cluster, tmp_path):
    result = bench(
        cluster, tmp_path,
        "--num-prompts", "12", "--input-len", "24", "--output-len", "6", "--range-ratio", "0.5",
        "--rates", "8,inf", "--ignore-eos", "--warmup", "2", "--seed", "5",
        "--slo", "ttft=60000,tpot=60000", "--plot", str(tmp_path / "plots"),
    )  # fmt: skip
    assert [run["request_rate"] for run in result["runs"]] == [8.0, "inf"]
    for run in result["runs"]:
        records = run["requests"]
        assert run["num_requests"] == len(records) == 12
        assert run["completed"] == 12 and run["failed"] == 0 and run["errors"] == {}
        # --ignore-eos: every request produced exactly its max_tokens, lengths varied.
        assert all(r["output_len"] == r["max_tokens"] for r in records)
        assert len({r["max_tokens"] for r in records}) > 1
        assert run["total_output_tokens"] == sum(r["max_tokens"] for r in records)
        assert run["total_input_tokens"] == sum(r["prompt_len"] for r in records)
        ttft = np.array([r["ttft_s"] for r in records]) * 1e3
        for key, q in (("median", 50), ("p90", 90), ("p99", 99)):
            assert run["ttft_ms"][key] == pytest.approx(np.percentile(ttft, q))
        tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_len"] - 1) * 1e3 for r in records]
        assert run["tpot_ms"]["mean"] == pytest.approx(np.mean(tpot))
        itl = [g * 1e3 for r in records for g in r["itl_s"]]
        assert len(itl) >= 1 and run["itl_ms"]["p99"] == pytest.approx(np.percentile(itl, 99))
        assert run["e2el_ms"]["p90"] == pytest.approx(
            np.percentile([r["e2e_s"] * 1e3 for r in records], 90)
        )
        assert run["num_good"] == 12  # the SLOs are a minute
        assert run["request_throughput"] == pytest.approx(12 / run["duration_s"])
        # Goodput counts exactly the records within SLOs that split them (the medians):
        # each objective alone, and both at once (a request must meet every one).
        recs = [RequestRecord(**r) for r in records]
        ttft_cut, tpot_cut = float(np.median(ttft)), float(np.median(tpot))
        cases = (
            (Slo(ttft_ms=ttft_cut), [t <= ttft_cut for t in ttft]),
            (Slo(tpot_ms=tpot_cut), [t <= tpot_cut for t in tpot]),
            (
                Slo(ttft_ms=ttft_cut, tpot_ms=tpot_cut),
                [a <= ttft_cut and b <= tpot_cut for a, b in zip(ttft, tpot, strict=True)],
            ),
        )
        for slo, within in cases:
            split = summarize(recs, run["duration_s"], slo)
            assert split["num_good"] == sum(within), slo
            assert split["goodput"] == pytest.approx(sum(within) / run["duration_s"])
        assert 6 <= sum(cases[0][1]) < 12 or len(set(ttft)) < 12
    # Each rate had prompts of its own: none was served from the earlier rate's cache.
    assert [run["cached_prompt_tokens"] for run in result["runs"]] == [0, 0]
    # At 8 req/s the sends are spread out; at inf they all go at once.
    sends = [sorted(r["send_s"] for r in run["requests"]) for run in result["runs"]]
    assert sends[0][-1] > 0.5 and sends[1][-1] < 0.5
    for name in ("latency_cdf.png", "rate_sweep.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000


def test_shared_prefix_workload_hits_the_prefix_cache(cluster, tmp_path):
    result = bench(
        cluster, tmp_path,
        "--dataset", "shared-prefix", "--num-groups", "2", "--prefix-len", "64",
        "--input-len", "8", "--output-len", "4", "--num-prompts", "6", "--max-concurrency", "1",
    )  # fmt: skip
    run = result["runs"][0]
    assert run["completed"] == 6
    # One at a time: the first request of each group misses, the other four find their
    # group's 64-token prefix (8 full blocks of 8) cached.
    cached = [r["cached_prompt_tokens"] for r in run["requests"]]
    assert cached[:2] == [0, 0] and all(c >= 64 for c in cached[2:]), cached
    assert run["cached_prompt_tokens"] == sum(cached)
    # Each record names the worker it decoded on (the only one here).
    assert {r["decode_worker"] for r in run["requests"]} == {"decode-0"}


def test_multi_turn_sessions_reuse_their_history(cluster, tmp_path):
    options = dict(sessions=3, turns=3, system=64, user=16, output=8, think=0.2, seed=3)
    args = (
        "--dataset", "multi-turn", "--num-sessions", "3", "--num-turns", "3",
        "--system-prompt-len", "64", "--input-len", "16", "--output-len", "8",
        "--think-time", "0.2", "--ignore-eos", "--seed", "3",
    )  # fmt: skip
    result = bench(cluster, tmp_path, *args)
    run = result["runs"][0]
    records = run["requests"]
    assert run["request_rate"] == "inf"  # every session starts at once
    assert run["completed"] == 9 and run["failed"] == 0
    assert [(r["session"], r["turn"]) for r in records] == [
        (i, t) for i in range(3) for t in range(3)
    ]
    assert all(r["output_len"] == r["max_tokens"] == 8 for r in records)
    # Each turn carries the whole history: system prompt, every message and reply so far.
    assert [r["prompt_len"] for r in records] == [64 + 16 * (t + 1) + 8 * t for t in (0, 1, 2)] * 3
    for r in records:
        if r["turn"]:
            # The previous turn's prompt (its full 8-token blocks) is in the prefix cache.
            assert r["cached_prompt_tokens"] >= (r["prompt_len"] - 24) // 8 * 8, r
    # The next turn went after the reply and the session's think time (same seed here).
    vocab = 1024  # the tiny model's
    workload = multi_turn_workload(
        options["sessions"], options["turns"], options["system"], options["user"],
        options["output"], 0.0, options["think"], vocab, options["seed"],
    )  # fmt: skip
    for r, before in zip(records[1:], records, strict=False):
        if r["turn"]:
            think = workload.sessions[r["session"]].think_s[r["turn"] - 1]
            assert r["send_s"] >= before["send_s"] + before["e2e_s"] + think - 1e-3
    turns = run["multi_turn"]
    for key, which in (("first_turn", [0]), ("later_turns", [1, 2])):
        ttft = [r["ttft_s"] * 1e3 for r in records if r["turn"] in which]
        assert turns[key]["completed"] == len(ttft)
        assert turns[key]["ttft_ms"]["median"] == pytest.approx(np.median(ttft))
        assert turns[key]["cached_prompt_tokens"] == sum(
            r["cached_prompt_tokens"] for r in records if r["turn"] in which
        )
    assert turns["requests_per_worker"] == {"decode-0": 9}
    assert turns["sessions_moved"] == 0
    # The same sessions again: now every history is in the prefix cache, and no reply changes.
    again = bench(cluster, tmp_path, *args)["runs"][0]["requests"]
    assert all(r["output_digest"] for r in records)
    assert [r["output_digest"] for r in again] == [r["output_digest"] for r in records]
    assert sum(r["cached_prompt_tokens"] for r in again) > run["cached_prompt_tokens"]


def test_trace_requests_go_no_earlier_than_their_timestamps(cluster, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [(0, 30, 3), (400, 20, 2), (150, 25, 4), (900, 10, 2)]
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": i, "output_length": o}) + "\n"
            for t, i, o in rows
        )
    )
    result = bench(cluster, tmp_path, "--dataset", "trace", "--trace", str(trace), "--ignore-eos")
    run = result["runs"][0]
    assert run["request_rate"] == "trace" and run["completed"] == 4
    sent = [(r["prompt_len"], r["max_tokens"], r["send_s"]) for r in run["requests"]]
    expected = [(30, 3, 0.0), (25, 4, 0.15), (20, 2, 0.4), (10, 2, 0.9)]
    for (plen, mtok, send), (want_plen, want_mtok, at) in zip(sent, expected, strict=True):
        assert (plen, mtok) == (want_plen, want_mtok)
        assert at <= send < at + 0.5


def test_bad_arguments_are_refused(cluster, tmp_path, capsys):
    assert baton(["bench", "--target", cluster.address, "--slo", "ttft=soon"]) == 2
    assert "--slo: ttft must be a number" in capsys.readouterr().err
    assert baton(["bench", "--target", cluster.address, "--input-len", "600"]) == 2
    assert "max_model_len (512)" in capsys.readouterr().err
    assert baton(["bench", "--target", cluster.address, "--dataset", "trace"]) == 2
    assert "--dataset trace needs --trace" in capsys.readouterr().err
    assert baton(["bench", "--target", cluster.address, "--dataset", "multi-turn",
                  "--num-turns", "20"]) == 2  # fmt: skip
    assert "over the model's max_model_len (512)" in capsys.readouterr().err
    assert baton(["bench", "--backend", "openai", "--base-url", "http://127.0.0.1:1",
                  "--dataset", "multi-turn"]) == 2  # fmt: skip
    assert "--dataset multi-turn: gRPC only" in capsys.readouterr().err
