"""The ``tracing`` section of the cluster config: one OpenTelemetry trace per request.

The router records each request's trace and its workers' spans of it, and exports the
kept traces over OTLP/HTTP (``router/tracing.py``, docs/tracing.md). Off by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.config_schema import ConfigSection, option

if TYPE_CHECKING:  # router/tracing.py loads the OpenTelemetry SDK: only when tracing is on
    from router.tracing import TracingConfig


class TracingSection(ConfigSection):
    enabled: bool = option(
        False, "Trace requests with OpenTelemetry (docs/tracing.md); off: nothing is recorded"
    )
    endpoint: str = option(
        "http://127.0.0.1:4318/v1/traces",
        "OTLP/HTTP traces endpoint the router exports kept traces to (a collector's)",
    )
    sample_ratio: float = option(
        0.01,
        "Share of traces kept, chosen by trace id; besides, every failed request, every one "
        "slower than slow_threshold_seconds and every one the caller sampled is kept",
        ge=0.0,
        le=1.0,
    )
    slow_threshold_seconds: float = option(
        10.0,
        "A request that takes at least this long (arrival to its last event) is kept "
        "whatever the ratio; 0 = none counts as slow",
        ge=0.0,
    )
    include_prompt: bool = option(
        False, "Put the prompt's text on the request's span (baton.prompt); off: no text"
    )
    service_name: str = option("baton", "The spans' OpenTelemetry service.name")

    def resolved(self) -> TracingConfig | None:
        """The router's tracing settings; None when off."""
        if not self.enabled:
            return None
        from router.tracing import TracingConfig

        return TracingConfig(
            endpoint=self.endpoint,
            sample_ratio=self.sample_ratio,
            slow_threshold_s=self.slow_threshold_seconds,
            include_prompt=self.include_prompt,
            service_name=self.service_name,
        )
