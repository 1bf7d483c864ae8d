"""Traces of a real cluster (Ray actors, NIXL, 1 prefill + 1 decode worker) exported over
OTLP/HTTP to a receiver in this test, which decodes the protobuf as a collector would.

Every request sent over gRPC and HTTP is one connected trace: the router's spans and both
workers' under one root, the KV receive with its bytes, and the caller's W3C context
continued where the client sent one; the trace id of a refusal is in its error body.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2 as httpx
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.e2e.conftest import cluster_config, free_port, start_cluster, stop_cluster
from tests.e2e.test_cluster import PROMPTS, collect, request

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = f"00-{CALLER_TRACE}-b7ad6b7169203331-01"


class Receiver:
    """An OTLP/HTTP traces endpoint: decodes each export and keeps its spans by trace id."""

    def __init__(self):
        self.spans: dict[str, list] = defaultdict(list)
        self.resources: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                export = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for resource_spans in export.resource_spans:
                        attrs = {
                            a.key: a.value.string_value for a in resource_spans.resource.attributes
                        }
                        receiver.resources.append(attrs)
                        for scope in resource_spans.scope_spans:
                            for span in scope.spans:
                                receiver.spans[span.trace_id.hex()].append(span)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, min_spans: int, timeout_s: float = 30.0) -> list:
        """The spans of ``trace_id`` once at least ``min_spans`` have come (the router's
        exporter sends in batches, every few seconds)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                spans = list(self.spans.get(trace_id, ()))
            if len(spans) >= min_spans:
                return spans
            time.sleep(0.2)
        raise AssertionError(f"trace {trace_id}: {len(spans)} spans, expected {min_spans}")


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tmp_path_factory):
    receiver = Receiver()
    port = free_port()
    config = cluster_config(tiny_model_dir, http_port=port)
    config["tracing"] = {
        "enabled": True,
        "endpoint": receiver.endpoint,
        "sample_ratio": 1.0,
        "service_name": "baton-e2e",
    }
    cluster = start_cluster(config, tmp_path_factory.mktemp("tracing"))
    cluster.base_url = f"http://127.0.0.1:{port}/v1"  # type: ignore[attr-defined]
    yield cluster, receiver
    code = stop_cluster(cluster)
    assert code == 0, cluster.output()[-4000:]
    receiver.server.shutdown()


def connected(spans) -> dict[str, list[str]]:
    """Asserts one connected tree and returns {parent name: child names}; the root is
    ``baton.request``, whose parent (if any) is outside the trace (the caller's)."""
    ids = {s.span_id: s for s in spans}
    roots = [s for s in spans if not s.parent_span_id or s.parent_span_id not in ids]
    assert [r.name for r in roots] == ["baton.request"], sorted(s.name for s in spans)
    children: dict[str, list[str]] = defaultdict(list)
    for span in spans:
        if span is not roots[0]:
            children[ids[span.parent_span_id].name].append(span.name)
    return children


def test_a_disaggregated_grpc_request_is_one_trace_over_otlp(traced):
    cluster, receiver = traced
    stub = cluster.stub()
    metadata = (("traceparent", CALLER),)
    token_ids, _, final = collect_with(
        stub, request("Tell me about tracing", max_tokens=8), metadata
    )
    assert len(token_ids) == 8
    spans = receiver.trace(CALLER_TRACE, min_spans=13)
    children = connected(spans)
    root = next(s for s in spans if s.name == "baton.request")
    assert root.parent_span_id.hex() == "b7ad6b7169203331"  # the caller's span
    assert sorted(children["baton.request"]) == [
        "attempt.decode",
        "attempt.prefill",
        "route",
        "validate",
    ]
    assert children["attempt.prefill"] == ["worker.prefill"]
    assert children["attempt.decode"] == ["worker.decode"]
    assert sorted(children["worker.prefill"]) == ["kv.offer", "prefill", "queue"]
    assert sorted(children["worker.decode"]) == ["decode", "kv.alloc_wait", "kv.receive"]
    receive = next(s for s in spans if s.name == "kv.receive")
    attrs = {a.key: a.value for a in receive.attributes}
    assert attrs["baton.kv.bytes"].int_value > 0
    assert {"service.name": "baton-e2e"}.items() <= receiver.resources[0].items()
    assert final.usage.completion_tokens == 8


def collect_with(stub, req, metadata):
    token_ids, final = [], None
    for msg in stub.Generate(req, timeout=60, metadata=metadata):
        body = msg.delta if msg.WhichOneof("kind") == "delta" else msg.final.delta
        token_ids.extend(body.token_ids)
        if msg.WhichOneof("kind") == "final":
            final = msg.final
    return token_ids, None, final


def test_http_requests_each_get_a_trace_and_a_refusal_names_its_own(traced):
    cluster, receiver = traced
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        ok = http.post(
            "/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
        )
        assert ok.status_code == 200, ok.text
        refused = http.post(
            "/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 100_000}
        )
    assert refused.status_code == 400
    trace_id = refused.json()["error"]["trace_id"]
    spans = receiver.trace(trace_id, min_spans=2)
    root = next(s for s in spans if s.name == "baton.request")
    assert root.status.code == root.status.STATUS_CODE_ERROR
    # The good one: its own trace, connected, with both workers' spans (disaggregated).
    before = time.monotonic()
    while time.monotonic() - before < 30:
        with receiver.lock:
            full = [
                spans
                for tid, spans in receiver.spans.items()
                if tid not in (trace_id, CALLER_TRACE) and len(spans) >= 13
            ]
        if full:
            break
        time.sleep(0.2)
    assert full, "no trace of the HTTP request"
    connected(full[0])


def test_tracing_changes_no_answer(traced, reference):
    """Traced, the cluster streams the same greedy tokens as the single-process engine."""
    cluster, _ = traced
    tokens, _, final = collect(cluster.stub(), request(PROMPTS[0]))
    assert tokens == reference[0]
    assert final.usage.completion_tokens == 24
