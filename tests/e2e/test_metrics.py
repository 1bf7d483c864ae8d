"""Prometheus metrics of a real cluster: after known requests, what ``/metrics`` shows.

One cluster (1 prefill + 1 decode worker on one Ray node, so one scrape endpoint) serves
the module. Each test scrapes before and after its requests and checks the differences
against what the clients saw: counts, token sums, KV bytes, cache hits, refusals.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import defaultdict

import grpc
import nixl  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
import pytest
import ray  # noqa: F401  (required by the served cluster: a broken install fails, not skips)
from prometheus_client.parser import text_string_to_metric_families

from proto.baton.v1 import inference_pb2 as pb
from tests.e2e.conftest import cluster_config, start_cluster, stop_cluster
from tests.e2e.test_cluster import collect, flood, request, wait_blocks_released

ROUTER = {"role": "router", "model": "tiny", "instance": "router"}
PREFILL = {"role": "prefill", "model": "tiny", "instance": "prefill-0"}
DECODE = {"role": "decode", "model": "tiny", "instance": "decode-0"}


# A request that is still decoding when the test looks: the tiny model's whole context
# (2048 positions), not 400 tokens, which it decodes in a fraction of a second.
LONG = 1950


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    config = cluster_config(tiny_model_dir, max_queued_requests=4)
    config["model"]["max_model_len"] = 2048  # room for LONG tokens after a short prompt
    served = start_cluster(config, tmp_path_factory.mktemp("metrics"))
    yield served
    (url,) = served.metrics_urls()
    code = stop_cluster(served)
    assert code == 0, served.output()[-4000:]
    with pytest.raises(OSError):  # the endpoint went with the cluster
        urllib.request.urlopen(url, timeout=5)


class Scrape:
    """One scrape of an endpoint: sample values by name and labels."""

    def __init__(self, url: str):
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        self.samples: dict[str, list[tuple[dict, float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[s.name].append((s.labels, s.value))

    def get(self, name: str, **labels) -> float:
        """The sum over the series of ``name`` whose labels include ``labels``."""
        return sum(v for have, v in self.samples.get(name, []) if labels.items() <= have.items())


def scrape(cluster) -> Scrape:
    (url,) = cluster.metrics_urls()  # one Ray node: one endpoint
    return Scrape(url)


def delta(before: Scrape, after: Scrape, name: str, **labels) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def test_one_endpoint_per_node_serves_router_and_worker_series(cluster):
    urls = cluster.metrics_urls()
    assert len(urls) == 1 and urls[0].startswith("http://127.0.0.1:")
    s = scrape(cluster)
    series = [labels for labels, _ in s.samples["baton_num_requests_running"]]
    for labels in (ROUTER, PREFILL, DECODE):
        assert labels in series
    assert s.samples["baton_kv_cache_usage_ratio"], "every worker reports its KV usage"


def _tokens_of(msg) -> list[int]:
    """The token ids one streamed message carries (a Delta's or the Final's)."""
    body = msg.delta if msg.WhichOneof("kind") == "delta" else msg.final.delta
    return list(body.token_ids)


def test_counts_and_sums_match_the_requests_sent(cluster):
    stub = cluster.stub()
    prompts = [f"metrics prompt number {i} with a few more words" for i in range(5)]
    max_tokens = 6
    before = scrape(cluster)
    finals, gaps = [], 0
    for prompt in prompts:
        req = request(prompt, max_tokens=max_tokens)
        req.output.return_timing = True
        messages = list(stub.Generate(req, timeout=60))
        assert [m.WhichOneof("kind") for m in messages][-1] == "final"
        chunks = [m for m in messages if _tokens_of(m)]
        assert sum(len(_tokens_of(m)) for m in chunks) == max_tokens
        finals.append(messages[-1].final)
        gaps += len(chunks) - 1
    wait_blocks_released(stub)
    after = scrape(cluster)
    n = len(prompts)
    d = lambda name, labels, **extra: delta(before, after, name, **labels, **extra)  # noqa: E731
    assert d("baton_requests_finished_total", ROUTER, finish_reason="length") == n
    for hist in ("time_to_first_token", "e2e_request_latency", "time_per_output_token"):
        assert d(f"baton_{hist}_seconds_count", ROUTER) == n
        assert d(f"baton_{hist}_seconds_bucket", ROUTER, le="+Inf") == n
    # One observation per gap between the chunks a client got: one token per chunk (the
    # first from the prefill worker, then one per decode step) unless a router that fell
    # behind merged a backlog into one chunk (router/stream.py), as it may on a loaded host.
    assert gaps <= n * (max_tokens - 1)
    assert d("baton_inter_token_latency_seconds_count", ROUTER) == gaps
    assert d("baton_generation_tokens_total", ROUTER) == n * max_tokens
    prompt_tokens = sum(f.usage.prompt_tokens for f in finals)
    assert d("baton_prompt_tokens_total", ROUTER) == prompt_tokens
    # Every request queued once on each worker; prefill looked its prompt up in the cache.
    assert d("baton_request_queue_time_seconds_count", PREFILL) == n
    assert d("baton_request_queue_time_seconds_count", DECODE) == n
    assert d("baton_prefix_cache_queried_tokens_total", PREFILL) == prompt_tokens
    assert d("baton_prefix_cache_queried_tokens_total", DECODE) == 0
    # The KV hand-offs: one per request on the decode worker, the bytes the clients saw.
    assert d("baton_kv_transfer_seconds_count", DECODE) == n
    assert d("baton_kv_transfer_bytes_count", DECODE) == n
    kv_bytes = sum(f.timing.kv_transfer_bytes for f in finals)
    assert kv_bytes > 0 and d("baton_kv_transfer_bytes_sum", DECODE) == kv_bytes
    kv_seconds = sum(f.timing.kv_transfer_seconds for f in finals)
    assert d("baton_kv_transfer_seconds_sum", DECODE) == pytest.approx(kv_seconds)
    assert d("baton_kv_transfer_failures_total", DECODE) == 0
    assert d("baton_kv_lease_expiries_total", PREFILL) == 0


def test_prefix_cache_hits_are_the_cached_tokens_clients_were_told(cluster):
    stub = cluster.stub()
    prompt = "a shared system prompt that is long enough to fill a few blocks of eight " * 2
    collect(stub, request(prompt, max_tokens=2))
    before = scrape(cluster)
    finals = [collect(stub, request(prompt + f" question {i}", max_tokens=2))[2] for i in range(3)]
    after = scrape(cluster)
    cached = sum(f.usage.cached_prompt_tokens for f in finals)
    assert cached >= 3 * 16, "the shared prefix must hit"
    assert delta(before, after, "baton_prefix_cache_hit_tokens_total", **PREFILL) == cached


def test_refusals_aborts_and_cancellations_are_counted(cluster):
    stub = cluster.stub()
    before = scrape(cluster)
    bad = request("x", max_tokens=4)
    bad.sampling.top_p = 2.0
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # Abort RPC: a Final with ABORT.
    finals = []
    thread = threading.Thread(
        target=lambda: finals.append(
            collect(stub, request("abort me", max_tokens=LONG, request_id="m-abort"))[2]
        )
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not stub.Abort(pb.AbortRequest(request_id="m-abort"), timeout=5).found:
        assert time.monotonic() < deadline, "the request never got in flight"
        time.sleep(0.02)
    thread.join(30)
    assert finals and finals[0].finish_reason == pb.FINISH_REASON_ABORT

    # Client cancellation after the first tokens.
    call = stub.Generate(request("cancel me", max_tokens=LONG), timeout=60)
    for msg in call:
        if msg.delta.token_ids:
            break
    call.cancel()
    wait_blocks_released(stub)

    # Past router.max_queued_requests (4): RESOURCE_EXHAUSTED, each one counted.
    codes = flood(stub, 12, max_tokens=40)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    wait_blocks_released(stub)
    after = scrape(cluster)
    d = lambda name, **labels: delta(before, after, name, **ROUTER, **labels)  # noqa: E731
    assert d("baton_requests_rejected_total", code="INVALID_ARGUMENT") == 1
    assert d("baton_requests_rejected_total", code="RESOURCE_EXHAUSTED") == codes.count(
        "RESOURCE_EXHAUSTED"
    )
    assert codes.count("RESOURCE_EXHAUSTED") > 0
    assert d("baton_requests_aborted_total", reason="abort") == 1
    assert d("baton_requests_finished_total", finish_reason="abort") == 1
    assert d("baton_requests_aborted_total", reason="cancelled") == 1
    assert d("baton_requests_finished_total", finish_reason="length") == codes.count("OK")
    assert d("baton_requests_failed_total") == 0


def wait_for(cluster, condition, timeout_s=10.0) -> Scrape:
    """Scrape until ``condition(scrape)``; worker gauges follow their reports (every
    step, and at least every 0.25 s when idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = scrape(cluster)
        if condition(s):
            return s
        assert time.monotonic() < deadline, dict(s.samples)
        time.sleep(0.1)


def test_gauges_follow_a_running_request(cluster):
    stub = cluster.stub()
    call = stub.Generate(request("keep running", max_tokens=LONG), timeout=60)
    it = iter(call)
    next(it)  # the first token: decoding now
    busy = wait_for(cluster, lambda s: s.get("baton_num_requests_running", **DECODE) == 1)
    assert busy.get("baton_num_requests_running", **ROUTER) == 1
    assert busy.get("baton_kv_cache_usage_ratio", **DECODE) > 0
    call.cancel()
    wait_blocks_released(stub)

    def idle(s: Scrape) -> bool:
        workers = all(
            s.get(name, **labels) == 0
            for name in ("baton_num_requests_running", "baton_num_requests_waiting",
                         "baton_kv_cache_usage_ratio")
            for labels in (PREFILL, DECODE)
        )  # fmt: skip
        return workers and s.get("baton_num_requests_running", **ROUTER) == 0

    wait_for(cluster, idle)
