"""The Prometheus names the router and the workers share (docs/metrics.md).

``baton_num_requests_running`` is one family for both sides, told apart by ``role``
(router | prefill | decode). prometheus-client registers a name once per process, and
in-process clusters (tests) record both sides in one process, so the family is defined
here once; the router imports it from here without loading the engine (and torch).
"""

from __future__ import annotations

from prometheus_client import Gauge

LABELS = ("role", "model", "instance")

RUNNING = Gauge(
    "baton_num_requests_running",
    "Requests being computed (or receiving their KV) on a worker",
    LABELS,
    multiprocess_mode="livesum",
)
