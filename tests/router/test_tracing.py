"""One trace per request across the router and its workers (router/tracing.py,
workers/serving/tracing.py), over real engines in one process (tests/router/test_router_flow.py's
cluster), exported to the SDK's in-memory exporter: the span tree of each path (aggregated,
disaggregated, recompute after a lost transfer, migration, abort), the caller's trace
continued, and which traces are kept."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from router.errors import RouterError
from router.server import generate_request
from router.tracing import Tracing, TracingConfig
from tests.router.test_migration import crash_after
from tests.router.test_router_flow import LONG_PREFIX, Cluster, collect, model_dir, req, run
from workers.protocol.trace import parse_traceparent

__all__ = ["model_dir"]  # the module fixture, shared

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def tracing(**config) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    settings = {"sample_ratio": 1.0, **config}
    return Tracing(TracingConfig(**settings), exporter=exporter), exporter


def traces(exporter: InMemorySpanExporter) -> dict[int, list]:
    by_trace: dict[int, list] = {}
    for span in exporter.get_finished_spans():
        by_trace.setdefault(span.context.trace_id, []).append(span)
    return by_trace


def tree(spans) -> dict:
    """``{name: {child name: ...}}`` from the request's root; asserts the spans form one
    connected tree (every parent is in the trace, except the root's remote parent)."""
    ids = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    assert [r.name for r in roots] == ["baton.request"], [r.name for r in roots]
    children: dict[int, list] = {}
    for span in spans:
        if span is not roots[0]:
            children.setdefault(span.parent.span_id, []).append(span)

    def shape(span) -> dict:
        kids = sorted(children.get(span.context.span_id, []), key=lambda s: s.start_time)
        return {
            f"{k.name}#{i}" if k.name.startswith("attempt") else k.name: shape(k)
            for i, k in enumerate(kids)
        }

    return {"baton.request": shape(roots[0])}


def by_name(spans, name: str):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def test_disaggregated_request_is_one_trace_from_router_to_decode(model_dir):
    tracer, exporter = tracing()
    cluster = Cluster(model_dir, disaggregation="always", tracing=tracer)

    async def body(router):
        result = await collect(router, req(LONG_PREFIX, max_tokens=8, request_id="d1"))
        await cluster.settled()
        return result

    tokens, _, final = run(cluster, body)
    (spans,) = traces(exporter).values()
    shape = tree(spans)["baton.request"]
    assert list(shape)[:2] == ["validate", "route"]
    prefill = shape["attempt.prefill#2"]["worker.prefill"]
    assert list(prefill) == ["queue", "prefill", "kv.offer"]
    decode = shape["attempt.decode#3"]["worker.decode"]
    assert list(decode) == ["kv.alloc_wait", "kv.receive", "decode"]
    root = by_name(spans, "baton.request")
    assert root.attributes["gen_ai.usage.input_tokens"] == final.usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == len(tokens) == 8
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert root.attributes["gen_ai.request.model"] == "tiny"
    receive = by_name(spans, "kv.receive")
    assert receive.attributes["baton.kv.bytes"] > 0
    # The hand-off's two ends: the decode worker's receive links to the prefill's offer.
    (link,) = receive.links
    assert link.context.span_id == by_name(spans, "kv.offer").context.span_id
    assert receive.attributes["baton.kv.source"] == "prefill"
    assert by_name(spans, "decode").attributes["baton.decode.tokens"] == 8
    assert by_name(spans, "prefill").attributes["baton.prefill.chunks"] >= 1
    route = by_name(spans, "route")
    assert route.attributes["baton.route.prefill"] == "prefill-0"
    assert route.attributes["baton.route.decode_scores"][0].startswith("decode-0=")
    # Every span lies inside the request's root, workers' clocks included.
    assert all(root.start_time <= s.start_time <= s.end_time <= root.end_time for s in spans)
    assert all(s.status.status_code is not StatusCode.ERROR for s in spans)


def test_aggregated_request_and_the_callers_trace_continued(model_dir):
    tracer, exporter = tracing(sample_ratio=0.0)  # kept because the caller sampled it
    cluster = Cluster(model_dir, num_prefill=0, disaggregation="never", tracing=tracer)

    async def body(router):
        request = replace(generate_request(req(LONG_PREFIX, max_tokens=4)), traceparent=CALLER)
        async for event in router.generate(request):
            last = event
        return last

    run(cluster, body)
    ((trace_id, spans),) = traces(exporter).items()
    assert trace_id == parse_traceparent(CALLER).trace_id
    root = by_name(spans, "baton.request")
    assert root.parent.span_id == parse_traceparent(CALLER).span_id
    shape = tree(spans)["baton.request"]
    assert list(shape["attempt.full#2"]["worker.full"]) == ["queue", "prefill", "decode"]


def test_lost_transfer_recomputes_and_the_trace_says_so(model_dir):
    tracer, exporter = tracing()
    cluster = Cluster(model_dir, hold_transfers=True, disaggregation="always", tracing=tracer)

    async def body(router):
        task = asyncio.ensure_future(collect(router, req(LONG_PREFIX, request_id="r2")))
        while "r2" not in router.decode[0].active:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        cluster.fabric.kill(cluster.services["prefill-0"].connector.agent_name)
        cluster.fabric.complete_held()
        return await task

    run(cluster, body)
    (spans,) = traces(exporter).values()
    tree(spans)
    receive = by_name(spans, "kv.receive")
    assert receive.status.status_code is StatusCode.ERROR
    assert [e.name for e in receive.events] == ["kv.recompute"]


def test_a_migration_continues_the_same_trace(model_dir):
    tracer, exporter = tracing()
    cluster = Cluster(model_dir, 0, 2, disaggregation="never", tracing=tracer)
    crash_after(cluster, "decode", 4)

    async def body(router):
        return await collect(router, req(LONG_PREFIX, max_tokens=12))

    run(cluster, body)
    (spans,) = traces(exporter).values()
    shape = tree(spans)["baton.request"]
    attempts = [k for k in shape if k.startswith("attempt.full")]
    assert len(attempts) == 2
    assert Counter(s.name for s in spans)["route"] == 2  # routed again after the loss
    root = by_name(spans, "baton.request")
    (migration,) = [e for e in root.events if e.name == "migration"]
    assert migration.attributes["baton.migration.cause"] == "decode_worker_died"
    assert root.attributes["baton.migrations"] == 1
    # The lost attempt failed; the other finished the request.
    first, second = sorted(
        (s for s in spans if s.name == "attempt.full"), key=lambda s: s.start_time
    )
    assert first.status.status_code is StatusCode.ERROR
    assert second.status.status_code is not StatusCode.ERROR


def test_an_abort_while_the_kv_is_in_flight_ends_every_span(model_dir):
    tracer, exporter = tracing()
    cluster = Cluster(model_dir, hold_transfers=True, disaggregation="always", tracing=tracer)

    async def body(router):
        task = asyncio.ensure_future(collect(router, req(LONG_PREFIX, request_id="r1")))
        while "r1" not in router.decode[0].active:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert await router.abort("r1")
        await task
        await asyncio.sleep(0.2)
        cluster.fabric.complete_held()
        await cluster.settled()

    run(cluster, body)
    (spans,) = traces(exporter).values()
    shape = tree(spans)["baton.request"]
    decode = shape["attempt.decode#3"]["worker.decode"]
    assert "kv.receive" in decode  # cut short
    root = by_name(spans, "baton.request")
    assert root.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert by_name(spans, "worker.decode").attributes["baton.finish_reason"] == "abort"


def test_kept_traces_ratio_errors_and_slow_requests(model_dir):
    tracer, exporter = tracing(sample_ratio=0.0, slow_threshold_s=0.0)
    cluster = Cluster(model_dir, num_prefill=0, disaggregation="never", tracing=tracer)

    async def body(router):
        await collect(router, req("hello", max_tokens=2))  # ordinary: dropped
        with pytest.raises(RouterError) as refused:
            await collect(router, req("hello", max_tokens=100_000))  # an error: kept
        return refused.value

    error = run(cluster, body)
    ((trace_id, spans),) = traces(exporter).items()
    assert error.trace_id == f"{trace_id:032x}"
    root = by_name(spans, "baton.request")
    assert root.status.status_code is StatusCode.ERROR
    assert "INVALID_ARGUMENT" in root.status.description
    assert by_name(spans, "validate").status.status_code is StatusCode.ERROR
    assert tracer.num_kept == 1 and tracer.num_dropped == 1

    slow_tracer, slow_exporter = tracing(sample_ratio=0.0, slow_threshold_s=1e-6)
    cluster = Cluster(model_dir, num_prefill=0, disaggregation="never", tracing=slow_tracer)
    run(cluster, lambda router: collect(router, req("hello", max_tokens=2)))
    assert len(traces(slow_exporter)) == 1  # slower than the threshold: kept


def test_no_prompt_text_unless_asked(model_dir):
    for include, expected in ((False, None), (True, "hello there")):
        tracer, exporter = tracing(include_prompt=include)
        cluster = Cluster(model_dir, num_prefill=0, disaggregation="never", tracing=tracer)
        run(cluster, lambda router: collect(router, req("hello there", max_tokens=2)))
        (spans,) = traces(exporter).values()
        assert by_name(spans, "baton.request").attributes.get("baton.prompt") == expected
        assert not any(
            "hello" in str(v) for s in spans for k, v in s.attributes.items() if k != "baton.prompt"
        )
