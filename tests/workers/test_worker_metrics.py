"""A worker's speculative-decoding counters follow the engine's cumulative counts, which
every report carries (workers/serving/metrics.py): each report adds what is new."""

from __future__ import annotations

from prometheus_client import REGISTRY

from workers.protocol.wire import WorkerReport
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
        hashes_version=0,
        cached_hashes=None,
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
