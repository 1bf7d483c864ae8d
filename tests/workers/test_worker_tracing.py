"""A worker's span records of a traced request (workers/serving/tracing.py), from the
moments the engine keeps: the tree per mode, onboarding from the KV tiers, speculative
counts, and nothing at all for a request without a traceparent."""

from __future__ import annotations

import time
from types import SimpleNamespace

from workers.protocol.sampling_params import SamplingParams
from workers.protocol.trace import TraceParent
from workers.protocol.wire import TokenEvent, WorkItem
from workers.serving.tracing import WorkerTraces

PARENT = TraceParent(0x1234, 0x99, 1)
TRACEPARENT = PARENT.header()


def item(mode="full", traceparent=TRACEPARENT):
    extra = {"kv_handles": (b"h",), "first_token_id": 1} if mode == "decode" else {}
    return WorkItem("r", tuple(range(40)), SamplingParams(), mode, traceparent=traceparent, **extra)


def engine_request(**fields):
    base = dict(
        request_id="r", first_scheduled_time=time.monotonic(), num_prefill_chunks=2,
        num_output_tokens=6, num_preemptions=1, onboard_ns=None, num_onboarded_tokens=0,
        num_spec_proposed=0, num_spec_accepted=0,
    )  # fmt: skip
    return SimpleNamespace(**(base | fields))


def test_a_full_request_with_onboarding_and_speculation():
    traces = WorkerTraces("decode-0", "decode")
    traces.admitted(item())
    now = time.time_ns()
    traces.first_scheduled(
        engine_request(
            onboard_ns=(now, now + 1000),
            num_onboarded_tokens=16,
            num_spec_proposed=8,
            num_spec_accepted=5,
        )
    )
    traces.first_token("r")
    spans = traces.finish(TokenEvent("r", (7,), True, "length", num_cached_tokens=16))
    by_name = {s.name: s for s in spans}
    assert [s.name for s in spans] == ["queue", "kv.onboard", "prefill", "decode", "worker.full"]
    worker = by_name["worker.full"]
    assert (worker.parent_span_id, worker.attributes["baton.finish_reason"]) == (0x99, "length")
    assert all(s.parent_span_id == worker.span_id for s in spans if s is not worker)
    assert by_name["kv.onboard"].attributes == {"baton.kv.onboarded_tokens": 16}
    assert by_name["prefill"].attributes["baton.prefill.chunks"] == 2
    decode = by_name["decode"].attributes
    assert decode["baton.spec.proposed_tokens"] == 8 and decode["baton.spec.accepted_tokens"] == 5
    assert decode["baton.preemptions"] == 1
    assert "r" not in traces  # forgotten once finished


def test_a_decode_request_and_an_untraced_one():
    traces = WorkerTraces("decode-0", "decode")
    traces.admitted(item("decode"))
    traces.first_scheduled(engine_request())
    traces.receive_started("r", "prefill", 4, 1)
    traces.receive_ended("r", 0.01, 4096)
    spans = traces.finish(TokenEvent("r", (), True, "length"))
    assert [s.name for s in spans] == ["kv.alloc_wait", "kv.receive", "decode", "worker.decode"]
    assert spans[1].attributes["baton.kv.bytes"] == 4096
    untraced = WorkerTraces("decode-0", "decode")
    untraced.admitted(item(traceparent=""))
    assert "r" not in untraced and untraced.finish(TokenEvent("r", (), True, "length")) == ()
