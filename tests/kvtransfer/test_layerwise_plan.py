"""The layer-group choice as a pure function: its timeline model and its threshold."""

from __future__ import annotations

import pytest

from kvtransfer.layerwise import (
    LayerwiseCost,
    choose_layer_groups,
    chunk_costs,
    layer_groups,
    predict_ttft,
)


def cost(layer_s=0.01, layer_bytes=1000, bandwidth=100_000.0, per_transfer_s=0.0, layers=4):
    return LayerwiseCost(layers, (layer_s,), (layer_bytes,), bandwidth, per_transfer_s)


def test_layer_groups_cover_every_layer_once():
    assert layer_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert layer_groups(4, 4) == [(0, 4)]
    with pytest.raises(ValueError):
        layer_groups(4, 0)


def test_timeline_by_hand():
    # 4 layers of 10 ms, 10 ms to move one layer, 1 ms per transfer.
    c = cost(per_transfer_s=0.001)
    assert predict_ttft(c, None) == pytest.approx(0.040 + 0.001 + 0.040)
    # groups of 2: ready at 20 and 40 ms; 21 ms each; the link is busy until 41, then 62.
    assert predict_ttft(c, 2) == pytest.approx(0.062)
    # per layer: ready every 10 ms, 11 ms each: the link lags, last lands at 10 + 4 * 11.
    assert predict_ttft(c, 1) == pytest.approx(0.054)


def test_transfer_bound_request_streams_per_layer():
    plan = choose_layer_groups(cost(per_transfer_s=0.001))
    assert plan.group_size == 1
    assert plan.predicted_s == pytest.approx(0.054) and plan.whole_s == pytest.approx(0.081)
    assert plan.gain == pytest.approx(1 - 0.054 / 0.081)


def test_fixed_cost_pushes_towards_larger_groups():
    # 10 ms per transfer: per layer costs 4 x 10 ms of overhead; two groups win.
    plan = choose_layer_groups(cost(per_transfer_s=0.010))
    assert plan.group_size == 2
    assert plan.predicted_s == pytest.approx(predict_ttft(cost(per_transfer_s=0.010), 2))


def test_small_gain_keeps_the_whole_request_hand_off():
    # The transfer is 1% of compute: layer-wise could save at most that, under min_gain.
    c = cost(layer_bytes=10, per_transfer_s=0.0001)
    plan = choose_layer_groups(c)
    assert plan.group_size is None and plan.predicted_s == plan.whole_s
    assert plan.layerwise_s < plan.whole_s  # it would have saved a little
    assert choose_layer_groups(c, min_gain=0.0).group_size is not None


def test_fixed_cost_above_the_gain_keeps_the_whole_request_hand_off():
    # A short prompt: tiny transfer, large fixed cost per transfer.
    plan = choose_layer_groups(cost(layer_bytes=10, per_transfer_s=0.020), min_gain=0.0)
    assert plan.group_size is None


def test_min_gain_seconds():
    c = cost(per_transfer_s=0.001)
    assert choose_layer_groups(c, min_gain_s=0.030).group_size is None  # saves 27 ms
    assert choose_layer_groups(c, min_gain_s=0.020).group_size == 1


def test_candidates_restrict_the_choice_and_are_checked():
    assert choose_layer_groups(cost(per_transfer_s=0.001), candidates=(2,)).group_size == 2
    with pytest.raises(ValueError):
        choose_layer_groups(cost(), candidates=(5,))


def test_chunks_earlier_transfers_overlap_later_compute():
    # Two chunks: the first chunk's transfer hides under the second's compute.
    c = LayerwiseCost(2, (0.01, 0.01), (1000, 1000), 100_000.0, 0.0)
    assert predict_ttft(c, None) == pytest.approx(0.040 + 0.040)
    assert predict_ttft(c, 1) == pytest.approx(0.040 + 0.010)


def test_chunk_costs_send_completed_blocks_then_the_rest():
    # 40 tokens in chunks of 16, 16, 8 with 16-token blocks: blocks 1, 1, then the tail 1.
    layer_s, layer_bytes = chunk_costs((16, 16, 8), 16, 0.001, 100)
    assert layer_s == pytest.approx((0.016, 0.016, 0.008))
    assert layer_bytes == (100, 100, 100)
    # 20 tokens in chunks of 10, 10: the first chunk completes no block.
    assert chunk_costs((10, 10), 16, 0.001, 100)[1] == (0, 200)


def test_cost_is_validated():
    with pytest.raises(ValueError):
        LayerwiseCost(0, (0.1,), (1,), 1.0, 0.0)
    with pytest.raises(ValueError):
        LayerwiseCost(2, (0.1,), (1, 2), 1.0, 0.0)
    with pytest.raises(ValueError):
        LayerwiseCost(2, (0.1,), (1,), 0.0, 0.0)
