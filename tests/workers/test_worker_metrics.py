"""A worker's speculative-decoding counters follow the engine's cumulative counts, which
every report carries (workers/serving/metrics.py): each report adds what is new; so do the
KV tiers' counters, per tier."""

from __future__ import annotations

from functools import partial

import msgspec
from prometheus_client import REGISTRY

from workers.protocol.wire import TierStatus, WorkerReport
from workers.serving.metrics import WorkerMetrics

NAMES = (
    "baton_spec_decode_verify_steps_total",
    "baton_spec_decode_draft_tokens_total",
    "baton_spec_decode_accepted_tokens_total",
)


def _report(steps: int, proposed: int, accepted: int) -> WorkerReport:
    return WorkerReport(
        name="decode-spec",
        role="decode",
        healthy=True,
        num_running=1,
        num_waiting=0,
        kv_blocks_total=8,
        kv_blocks_used=2,
        kv_blocks_cached=0,
        num_held=0,
        spec_num_steps=steps,
        spec_num_draft_tokens=proposed,
        spec_num_accepted_tokens=accepted,
    )


def _counters(instance: str) -> tuple[float, ...]:
    labels = {"role": "decode", "model": "tiny", "instance": instance}
    return tuple(REGISTRY.get_sample_value(name, labels) for name in NAMES)


def test_reports_move_the_counters_by_what_is_new():
    metrics = WorkerMetrics("decode", "tiny", "decode-spec-a")
    assert _counters("decode-spec-a") == (0, 0, 0)  # present from the start, at zero
    metrics.report(_report(2, 8, 5))
    assert _counters("decode-spec-a") == (2, 8, 5)
    metrics.report(_report(2, 8, 5))  # a heartbeat with nothing new
    assert _counters("decode-spec-a") == (2, 8, 5)
    metrics.report(_report(7, 28, 20))
    assert _counters("decode-spec-a") == (7, 28, 20)


def test_workers_count_apart():
    a, b = (
        WorkerMetrics("decode", "tiny", "decode-spec-b"),
        WorkerMetrics("decode", "tiny", "decode-spec-c"),
    )
    a.report(_report(1, 4, 4))
    b.report(_report(3, 12, 0))
    assert _counters("decode-spec-b") == (1, 4, 4)
    assert _counters("decode-spec-c") == (3, 12, 0)


def _tier(name: str, blocks: int, hits: int, onboard_s: float) -> TierStatus:
    return TierStatus(
        name=name, blocks=blocks, bytes=blocks * 1024, capacity_blocks=64,
        capacity_bytes=64 * 1024, hits=hits, misses=2 * hits, errors=1, onboard_bytes=hits * 1024,
        onboard_seconds=onboard_s, offload_bytes=blocks * 1024, offload_seconds=0.5,
        evictions=hits // 2, rejected=0,
    )  # fmt: skip


def _tier_value(name: str, instance: str, tier: str) -> float | None:
    labels = {"role": "decode", "model": "tiny", "instance": instance, "tier": tier}
    return REGISTRY.get_sample_value(name, labels)


def test_each_tier_has_its_series_gauges_set_and_counters_adding_what_is_new():
    metrics = WorkerMetrics("decode", "tiny", "decode-tier-a")
    report = _report(0, 0, 0)
    metrics.report(msgspec.structs.replace(report, kv_tiers=(_tier("host", 10, 4, 0.25),)))
    metrics.report(
        msgspec.structs.replace(
            report, kv_tiers=(_tier("host", 6, 9, 1.0), _tier("disk", 30, 2, 3.0))
        )
    )
    value = partial(_tier_value, instance="decode-tier-a")
    assert value("baton_kv_tier_blocks", tier="host") == 6  # a gauge: the latest
    assert value("baton_kv_tier_bytes", tier="disk") == 30 * 1024
    assert value("baton_kv_tier_capacity_bytes", tier="host") == 64 * 1024
    assert value("baton_kv_tier_hits_total", tier="host") == 9  # a counter: the total
    assert value("baton_kv_tier_misses_total", tier="host") == 18
    assert value("baton_kv_tier_errors_total", tier="disk") == 1
    assert value("baton_kv_tier_onboard_seconds_total", tier="host") == 1.0
    assert value("baton_kv_tier_onboard_bytes_total", tier="disk") == 2 * 1024
    assert value("baton_kv_tier_offload_bytes_total", tier="host") == 10 * 1024  # never back
    assert value("baton_kv_tier_offload_seconds_total", tier="disk") == 0.5
    assert value("baton_kv_tier_evictions_total", tier="host") == 4
    assert value("baton_kv_tier_rejected_offloads_total", tier="disk") == 0


def test_receive_and_peer_pull_series_start_at_zero_and_count_apart_by_source_and_result():
    metrics = WorkerMetrics("decode", "tiny", "decode-recv-a")
    labels = {"role": "decode", "model": "tiny", "instance": "decode-recv-a"}

    def value(name: str, **extra: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**labels, **extra})

    for source in ("prefill", "peer"):
        assert value("baton_kv_receive_blocks_total", source=source) == 0
        assert value("baton_kv_receive_saved_bytes_total", source=source) == 0
    metrics.receive_started("prefill", 3, 2)
    metrics.receive_saved("prefill", 200)
    metrics.receive_started("peer", 5, 0)
    metrics.peer_pull("recomputed")
    assert value("baton_kv_receive_blocks_total", source="prefill") == 3
    assert value("baton_kv_receive_reused_blocks_total", source="prefill") == 2
    assert value("baton_kv_receive_saved_bytes_total", source="prefill") == 200
    assert value("baton_kv_receive_blocks_total", source="peer") == 5
    assert value("baton_kv_peer_pulls_total", result="recomputed") == 1
    assert value("baton_kv_peer_pulls_total", result="received") == 0
