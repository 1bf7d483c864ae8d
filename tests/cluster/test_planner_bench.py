"""bench/planner.py's pieces: the Mooncake-format reader (prefix hits from hash_ids), the
varying-rate trace, and the replay's reversal and reaction counts."""

from __future__ import annotations

import json

from bench.planner import (
    Setup,
    growth_needed,
    most_reversals_within,
    reaction_ticks,
    read_mooncake,
    reversals,
    sine_bursts,
    true_model,
    windows_of,
)
from cluster.planner.simulator import SimRequest


def test_mooncake_reader_counts_leading_blocks_seen_before_as_prefix_hits(tmp_path):
    rows = [
        {"timestamp": 3000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 2, 3]},
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 6000, "input_length": 1500, "output_length": 9, "hash_ids": [0, 2, 4]},
        {"timestamp": 6500, "input_length": 600, "output_length": 1, "hash_ids": [5, 0]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    requests = read_mooncake(path)
    # file order decides what was seen: row 1 (t=3 s) is first, its blocks all new
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests] == [
        (0.0, 1000 - 512, 5),  # block 0 seen (row 1), block 1 new
        (3.0, 1100, 7),
        (6.0, 1500 - 2 * 512, 9),  # blocks 0 and 2 seen
        (6.5, 600, 1),  # a new first block: no hit, whatever follows
    ]


def test_sine_bursts_is_seeded_and_denser_in_its_bursts():
    a, starts = sine_bursts(1200.0, period_s=1200.0, bursts=((600.0, 60.0, 3.0),), seed=5)
    b, _ = sine_bursts(1200.0, period_s=1200.0, bursts=((600.0, 60.0, 3.0),), seed=5)
    assert a == b and starts == [600.0]
    in_burst = sum(600 <= r.arrival_s < 660 for r in a)
    before = sum(540 <= r.arrival_s < 600 for r in a)
    assert in_burst > before + 100  # 3 req/s more for 60 s


def test_reversals_and_reaction_ticks():
    pools = [(1, 1), (2, 1), (2, 1), (1, 1), (1, 2), (1, 1), (1, 1)]
    assert reversals(pools) == 2  # prefill up then down; decode up then down
    assert reaction_ticks([(1, 1), (1, 1), (1, 1), (2, 1)], [35.0], 30.0) == [2]
    assert reaction_ticks([(1, 1), (1, 1)], [5.0], 30.0) == [-1]
    assert reaction_ticks([(1, 1), (1, 1)], [5.0], 30.0, needed=[False]) == [None]
    # reversals at windows 3 (prefill) and 5 (decode): two within 3 windows, one in 2
    assert most_reversals_within(pools, 3) == 2 and most_reversals_within(pools, 2) == 1
    assert most_reversals_within([(1, 1), (2, 2)], 5) == 0


def test_growth_is_needed_only_where_the_pools_at_the_step_miss():
    # A step from 0.3 to 3 req/s of 200-token prompts for 60 s: one prefill worker of the
    # bench's machine (20 ms + 1 ms a token) runs out of its ~4.5 prompts a second at the
    # step only with 800-token prompts, which it then needs help with.
    setup, truth = Setup(), true_model()
    light, heavy, t = [], [], 0.0
    for i in range(400):
        t = 60.0 + i / 3.0 if i >= 18 else i / 0.3
        light.append(SimRequest(t, 200, 20))
        heavy.append(SimRequest(t, 200 if i < 18 else 800, 20))
    pools = [(1, 1)] * 10
    assert growth_needed(windows_of(light[:198], 30.0), [(60.0, 60.0)], pools, truth, setup) == [
        False
    ]
    assert growth_needed(windows_of(heavy[:198], 30.0), [(60.0, 60.0)], pools, truth, setup) == [
        True
    ]
