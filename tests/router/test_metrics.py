"""The router's per-call metrics over typed events: one outcome per call, tokens counted."""

from __future__ import annotations

from prometheus_client import REGISTRY

from router.errors import ErrorCode
from router.events import Delta, Finish, GenerateEvent, Usage
from router.metrics import RouterMetrics


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
