"""The router's per-call metrics over typed events: one outcome per call, tokens counted."""

from __future__ import annotations

from prometheus_client import REGISTRY

from router import metrics as router_metrics
from router.errors import ErrorCode
from router.events import Delta, Finish, GenerateEvent, Usage
from router.metrics import ITL, Observations, RouterMetrics


def sample(name: str, model: str, **labels) -> float:
    """A router series of the gRPC front end (the running gauge has no front end label)."""
    if name != "baton_num_requests_running":
        labels = {"frontend": "grpc", **labels}
    value = REGISTRY.get_sample_value(
        name, {"role": "router", "model": model, "instance": "router", **labels}
    )
    return value or 0.0


def test_one_outcome_per_call():
    model = "metrics-unit"  # labels of its own: other tests' calls do not count here
    metrics = RouterMetrics(model)
    call = metrics.call()
    assert sample("baton_num_requests_running", model) == 1
    call.event(GenerateEvent("r", Delta((1, 2))))
    call.event(GenerateEvent("r", Delta((3,)), Finish("length", Usage(5, 3, 0))))
    call.closed()
    assert sample("baton_requests_finished_total", model, finish_reason="length") == 1
    assert sample("baton_generation_tokens_total", model) == 3
    assert sample("baton_prompt_tokens_total", model) == 5
    assert sample("baton_time_to_first_token_seconds_count", model) == 1
    assert sample("baton_time_per_output_token_seconds_count", model) == 1

    metrics.call().error(ErrorCode.INVALID_ARGUMENT)  # before any token: a rejection
    failed = metrics.call()
    failed.event(GenerateEvent("r", Delta((1,))))
    failed.error(ErrorCode.UNAVAILABLE)  # after output began: a failure
    failed.closed()
    metrics.call().closed()  # the client went away
    aborted = metrics.call()
    aborted.event(GenerateEvent("r", Delta(), Finish("abort", Usage(5, 0, 0))))
    assert sample("baton_requests_rejected_total", model, code="INVALID_ARGUMENT") == 1
    assert sample("baton_requests_failed_total", model, code="UNAVAILABLE") == 1
    assert sample("baton_requests_aborted_total", model, reason="cancelled") == 1
    assert sample("baton_requests_aborted_total", model, reason="abort") == 1
    assert sample("baton_num_requests_running", model) == 0


def test_batched_observations_fill_the_buckets_observe_would():
    """``Observations`` (per-chunk latencies kept in plain numbers, flushed later) leaves
    every bucket, the count and the sum as ``Histogram.observe`` leaves them."""
    direct = ITL.labels("router", "obs-direct", "router", "grpc")
    batched = ITL.labels("router", "obs-batched", "router", "grpc")
    observations = Observations(batched)
    values = [0.0, 0.001, 0.0011, 0.02, 0.3, 2.5, 7.0, 0.001]  # on bounds, between, past all
    for value in values:
        direct.observe(value)
        observations.observe(value)
    observations.flush()
    observations.flush()  # nothing new: adds nothing

    def series(model: str) -> dict[tuple[str, str], float]:
        (family,) = ITL.collect()
        return {
            (s.name, s.labels.get("le", "")): s.value
            for s in family.samples
            if s.labels["model"] == model and not s.name.endswith("_created")
        }

    assert series("obs-batched") == series("obs-direct")
    assert series("obs-direct")[("baton_inter_token_latency_seconds_count", "")] == len(values)


def test_chunk_counts_reach_prometheus_by_the_flush_interval_or_the_calls_end(monkeypatch):
    model = "metrics-flush"
    metrics = RouterMetrics(model)
    monkeypatch.setattr(router_metrics, "FLUSH_EVERY_S", 3600.0)
    call = metrics.call()
    call.event(GenerateEvent("r", Delta((1,))))
    call.event(GenerateEvent("r", Delta((2, 3))))
    assert sample("baton_time_to_first_token_seconds_count", model) == 1  # at once
    assert sample("baton_generation_tokens_total", model) == 0  # counted, not flushed yet
    assert sample("baton_inter_token_latency_seconds_count", model) == 0
    call.closed()  # a call's end flushes
    assert sample("baton_generation_tokens_total", model) == 3
    assert sample("baton_inter_token_latency_seconds_count", model) == 1

    monkeypatch.setattr(router_metrics, "FLUSH_EVERY_S", 0.0)  # every chunk past the interval
    call = metrics.call()
    call.event(GenerateEvent("r", Delta((4,))))
    call.event(GenerateEvent("r", Delta((5,))))
    assert sample("baton_generation_tokens_total", model) == 5  # mid-call
    assert sample("baton_inter_token_latency_seconds_count", model) == 2
    call.closed()
