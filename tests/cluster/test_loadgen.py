"""The load generator's parts without a cluster: datasets, arrivals, SLO parsing and the
metrics, on hand-made records whose answers are worked out here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cluster.loadgen.arrivals import arrival_offsets
from cluster.loadgen.datasets import (
    TRACE_BLOCK_TOKENS,
    random_dataset,
    shared_prefix_dataset,
    trace_dataset,
)
from cluster.loadgen.metrics import Slo, summarize, tpot_s
from cluster.loadgen.runner import RequestRecord

VOCAB = 1000


def test_random_lengths_stay_in_range_and_are_reproducible():
    reqs = random_dataset(200, 100, 20, 0.5, VOCAB, seed=3)
    assert {len(r.prompt_ids) for r in reqs} <= set(range(50, 151))
    assert {r.max_tokens for r in reqs} <= set(range(10, 31))
    assert len({len(r.prompt_ids) for r in reqs}) > 20  # lengths do vary
    assert all(10 <= t < VOCAB for r in reqs for t in r.prompt_ids)
    assert reqs == random_dataset(200, 100, 20, 0.5, VOCAB, seed=3)
    assert [len(r.prompt_ids) for r in random_dataset(5, 7, 3, 0.0, VOCAB, 0)] == [7] * 5


def test_shared_prefix_groups_share_exactly_the_prefix():
    reqs = shared_prefix_dataset(9, 3, 40, 5, 8, VOCAB, seed=1)
    assert all(len(r.prompt_ids) == 45 and r.max_tokens == 8 for r in reqs)
    for i, r in enumerate(reqs):
        same = reqs[i % 3]
        assert r.prompt_ids[:40] == same.prompt_ids[:40]
        assert r.prompt_ids[:40] != reqs[(i + 1) % 3].prompt_ids[:40]
    assert len({r.prompt_ids[40:] for r in reqs}) == 9  # suffixes differ


def test_trace_orders_by_time_and_shares_blocks_by_hash_id(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [7, 9]},
        {"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 2250, "input_length": 20, "output_length": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = trace_dataset(path, None, VOCAB, seed=0)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.25]
    assert [(len(r.prompt_ids), r.max_tokens) for r in reqs] == [(700, 5), (600, 3), (20, 2)]
    block = TRACE_BLOCK_TOKENS
    assert reqs[0].prompt_ids[:block] == reqs[1].prompt_ids[:block]  # hash id 7
    assert reqs[0].prompt_ids[block:600] != reqs[1].prompt_ids[block:600]  # 8 vs 9
    assert len(trace_dataset(path, 2, VOCAB, seed=0)) == 2


def test_a_bad_trace_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trace record"):
        trace_dataset(path, None, VOCAB, 0)


def test_poisson_arrivals_have_the_asked_rate():
    offsets = arrival_offsets(20_000, rate=4.0, burstiness=1.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert abs(gaps.mean() - 0.25) < 0.01
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.03  # exponential: CV = 1
    bursty = np.diff(arrival_offsets(20_000, rate=4.0, burstiness=0.25, seed=0))
    assert abs(bursty.mean() - 0.25) < 0.02
    assert abs(bursty.std() / bursty.mean() - 2.0) < 0.1  # gamma: CV = 1/sqrt(k)
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_offsets(3, 1.0, 0.0, 0)


def test_slo_parsing():
    assert Slo.parse("ttft=500, tpot=50") == Slo(ttft_ms=500.0, tpot_ms=50.0)
    assert Slo.parse("") == Slo()
    for bad, message in (
        ("ttft", "KEY=MS"),
        ("speed=3", "KEY=MS"),
        ("tpot=fast", "number"),
        ("e2el=0", "> 0"),
    ):
        with pytest.raises(ValueError, match=message):
            Slo.parse(bad)


def record(i, ttft, itl, output_len, error=""):
    r = RequestRecord(i, prompt_len=10 + i, max_tokens=output_len, ttft_s=ttft, itl_s=list(itl))
    r.output_len = output_len
    r.e2e_s = None if error else ttft + sum(itl)
    r.error = error
    return r


def test_summary_of_known_records():
    records = [
        record(0, 0.100, [0.010, 0.030], 3),  # TPOT 20 ms
        record(1, 0.300, [0.050], 2),  # TPOT 50 ms
        record(2, 0.050, [], 1),  # no TPOT
        record(3, 0.0, [], 0, error="UNAVAILABLE"),
    ]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=150, tpot_ms=30))
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"UNAVAILABLE": 1}
    assert s["total_input_tokens"] == 10 + 11 + 12 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 3.0
    assert s["num_good"] == 2 and s["goodput"] == 1.0  # records 0 and 2
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(35.0)
    assert s["itl_ms"]["p90"] == pytest.approx(np.percentile([10, 30, 50], 90))
    assert s["e2el_ms"]["p99"] == pytest.approx(np.percentile([140, 350, 50], 99))
    assert tpot_s(records[2]) is None
    empty = summarize([records[3]], 1.0, Slo())
    assert empty["ttft_ms"] == {"mean": None, "median": None, "std": None, "p90": None, "p99": None}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--backend", "openai"], "--base-url: required"),
        (["--backend", "openai", "--base-url", "http://h:1", "--target", "h:2"], "--target:"),
        (["--base-url", "http://h:1"], "--target: required"),
        (["--target", "h:2", "--base-url", "http://h:1"], "--base-url: only with"),
    ],
)
def test_backend_arguments_are_named(argv, named, capsys):
    from cluster.cli import main as baton

    assert baton(["bench", *argv]) == 2
    assert named in capsys.readouterr().err


def test_base_url_gets_its_v1():
    from cluster.loadgen.openai_runner import normalise_base_url

    assert normalise_base_url("http://h:8000") == "http://h:8000/v1"
    assert normalise_base_url("http://h:8000/v1/") == "http://h:8000/v1"
