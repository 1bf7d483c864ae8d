"""cluster.client against a fake servicer on loopback (tests/cluster/fake_router.py)."""

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cluster import cli
from cluster.client import (
    DISAGGREGATION_CHOICES,
    SERVICE_NAME,
    format_status,
    format_usage_and_timing,
    get_status,
    make_request,
    parse_target,
    stream_generate,
    wait_ready,
)
from proto.baton.v1 import inference_pb2 as pb
from workers.engine.speculative.stats import SpecDecodeStats

from .fake_router import STATUS, TIMING, closed_port


def test_cli_choices_match_client():
    assert cli._DISAGGREGATION == DISAGGREGATION_CHOICES


# ---- parse_target ---------------------------------------------------------------------


@pytest.mark.parametrize("target", ["localhost:50051", "10.0.0.7:1", "[::1]:65535", "a.b:80"])
def test_parse_target_accepts(target):
    assert parse_target(target) == target


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("localhost", "missing ':PORT'"),
        (":50051", "missing HOST"),
        ("localhost:", "is not a number"),
        ("localhost:http", "is not a number"),
        ("localhost:²", "is not a number"),
        ("localhost:0", "outside 1-65535"),
        ("localhost:65536", "outside 1-65535"),
        ("http://localhost:50051", "without a scheme"),
        ("::1:50051", "needs brackets"),
        ("[]:50051", "bad IPv6 host"),
        ("my host:1", "whitespace"),
    ],
)
def test_parse_target_rejects(target, problem):
    with pytest.raises(ValueError, match="target") as info:
        parse_target(target)
    assert problem in str(info.value)


# ---- make_request / stream_generate ---------------------------------------------------


def test_make_request_leaves_unset_options_unset():
    assert make_request("hi") == pb.GenerateRequest(text="hi")
    req = make_request([1, 2, 3], temperature=0.0)
    assert list(req.token_ids.ids) == [1, 2, 3]
    # Greedy must reach the server as an explicit 0, not as "use your default".
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0
    for name in ("top_p", "top_k", "seed", "min_p", "speculative"):
        assert not req.sampling.HasField(name)
    assert not req.HasField("stopping") and not req.HasField("output")
    assert req.disaggregation == pb.DISAGGREGATION_UNSPECIFIED


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"seed": -5}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"disaggregation": "sometimes"}, "disaggregation"),
    ],
)
def test_make_request_rejects_what_the_wire_cannot_carry(kwargs, named):
    with pytest.raises(ValueError, match=named):
        make_request("hi", **kwargs)
    with pytest.raises(ValueError, match="prompt token id"):
        make_request([1, -2])


def test_stream_generate_sends_every_option(server, stub):
    responses = list(
        stream_generate(
            stub,
            "hi",
            max_tokens=9,
            temperature=0.5,
            top_p=0.9,
            top_k=-1,
            seed=(1 << 64) - 1,
            stop=["\n"],
            ignore_eos=True,
            disaggregation="always",
            return_timing=True,
            timeout_s=10,
        )
    )
    assert [r.WhichOneof("kind") for r in responses] == ["delta", "delta", "final"]
    assert responses[-1].final.timing == TIMING
    (received,) = server.servicer.requests
    assert received == pb.GenerateRequest(
        text="hi",
        sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, top_k=-1, seed=(1 << 64) - 1),
        stopping=pb.StoppingCriteria(max_tokens=9, stop=["\n"], ignore_eos=True),
        output=pb.OutputOptions(return_timing=True),
        disaggregation=pb.DISAGGREGATION_ALWAYS,
    )


def test_stream_generate_raises_the_server_status(stub):
    with pytest.raises(grpc.RpcError) as info:
        list(stream_generate(stub, ""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is empty" in info.value.details()


# ---- get_status / format_status / wait_ready ------------------------------------------


def test_get_status(stub):
    assert get_status(stub, timeout_s=5) == STATUS


def test_format_status():
    text = format_status(STATUS)
    lines = text.splitlines()
    for header in ("model:", "policy:", "disaggregation:", "kv transfer:", "draining:"):
        assert any(line.startswith(header) for line in lines), header
    assert "kv_aware" in text and "tiny-llama" in text and "draining:        no" in text
    assert "prefill pool: 1/1 healthy" in text and "decode pool: 1/2 healthy" in text
    (prefill_row,) = [line for line in lines if "prefill-0" in line]
    assert prefill_row.split() == [
        *("prefill-0", "prefill", "yes", "2", "1", "3", "1", "0"),
        *("128", "(12.5%)", "256", "(25.0%)", "1024"),
    ]
    (decode_row,) = [line for line in lines if "decode-0" in line]
    assert decode_row.split()[5:8] == ["17", "0", "5"]  # running, waiting, incoming
    (sick_row,) = [line for line in lines if "decode-1" in line]
    assert sick_row.split() == [
        *("decode-1", "decode", "NO", "0", "0", "0", "0", "0"),
        *("0", "(-)", "0", "(-)", "0"),
    ]
    # Columns line up: names start, and right-aligned numbers end, at the same offsets.
    table = lines[lines.index("decode pool: 1/2 healthy") + 1 :]
    assert [row.split()[0] for row in table] == ["WORKER", "decode-0", "decode-1"]
    assert len({len(row) for row in table}) == 1
    assert {row.index("decode", len("  decode-0")) for row in table[1:]} == {table[0].index("ROLE")}
    assert format_status(pb.ClusterStatus()).endswith("(no pools)")
    sick = pb.WorkerStatus(name="decode-1", role="decode", state="restarting")
    restarting = pb.ClusterStatus(pools=[pb.PoolStatus(role="decode", workers=[sick])])
    assert "decode-1  decode  NO (restarting)" in format_status(restarting)


def test_format_status_shows_each_workers_kv_tiers_when_it_has_some():
    assert "KV tiers" not in format_status(STATUS)
    status = pb.ClusterStatus()
    status.CopyFrom(STATUS)
    worker = status.pools[1].workers[0]
    worker.kv_tiers.add(
        name="host", blocks=64, bytes=64 << 20, capacity_blocks=256, capacity_bytes=256 << 20,
        hits=30, misses=10,
    )  # fmt: skip
    worker.kv_tiers.add(name="disk", capacity_blocks=4096, capacity_bytes=4 << 30)
    lines = format_status(status).splitlines()
    table = lines[lines.index("  KV tiers:") + 1 :]
    assert table[0].split() == ["WORKER", "TIER", "BLOCKS", "BYTES", "HIT", "RATE"]
    assert table[1].split() == [
        *("decode-0", "host", "64", "/", "256", "(25.0%)"),
        *("64.0", "MiB", "/", "256.0", "MiB", "(25.0%)", "75.0%", "of", "40"),
    ]
    assert table[2].split() == [
        *("decode-0", "disk", "0", "/", "4096", "(0.0%)", "0", "B", "/", "4.0", "GiB", "(0.0%)", "-"),
    ]  # fmt: skip
    assert len({len(row) for row in table}) == 1
    # Only the pool whose workers have tiers shows the table.
    assert lines.index("  KV tiers:") > lines.index("decode pool: 1/2 healthy")


def test_format_status_shows_speculation_per_decode_worker_when_on():
    assert "speculative:     off" in format_status(STATUS).splitlines()
    assert "SPEC" not in format_status(STATUS)
    status = pb.ClusterStatus()
    status.CopyFrom(STATUS)
    status.speculative = "ngram, 4 tokens"
    worker = status.pools[1].workers[0]
    # 10 verify steps proposed 40 tokens, 25 accepted: 62.5%, 3.5 tokens per step.
    worker.spec_num_steps = 10
    worker.spec_num_draft_tokens = 40
    worker.spec_num_accepted_tokens = 25
    lines = format_status(status).splitlines()
    assert "speculative:     ngram, 4 tokens" in lines
    table = lines[lines.index("decode pool: 1/2 healthy") + 1 :]
    assert table[0].split()[-4:] == ["SPEC", "ACCEPTED", "SPEC", "LEN"]
    assert table[1].split()[-2:] == ["62.5%", "3.50"]
    # The engine's own definitions (workers/engine/speculative/stats.py) give the same.
    stats = SpecDecodeStats(num_steps=10, num_draft_tokens=40, num_accepted_tokens=25)
    assert (stats.acceptance_rate, stats.mean_accepted_length) == (0.625, 3.5)
    assert table[2].split()[-2:] == ["-", "-"]  # no verify step yet
    assert len({len(row) for row in table}) == 1
    prefill = lines[lines.index("prefill pool: 1/1 healthy") + 1]
    assert "SPEC" not in prefill  # prefill never speculates


def test_format_usage_and_timing():
    final = pb.Final(usage=pb.Usage(prompt_tokens=4, completion_tokens=8, cached_prompt_tokens=2))
    assert format_usage_and_timing(final).splitlines() == [
        "usage: 4 prompt tokens (2 cached), 8 completion tokens",
        "timing: not returned by the server",
    ]
    final.timing.CopyFrom(TIMING)
    text = format_usage_and_timing(final)
    assert "prefill 12.0 ms" in text and "(3.0 MiB)" in text and "e2e 250.0 ms" in text
    assert "prefill prefill-0, decode decode-0" in text
    final.timing.prefill_worker = ""
    assert "prefill local" in format_usage_and_timing(final)


def test_wait_ready(server):
    with grpc.insecure_channel(server.target) as channel:
        wait_ready(channel, timeout_s=5)

        server.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(TimeoutError, match="NOT_SERVING"):
            wait_ready(channel, timeout_s=0.3)

        # It keeps polling: a server that becomes ready while it waits is seen.
        timer = threading.Timer(
            0.2, server.health.set, (SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        )
        timer.start()
        try:
            wait_ready(channel, timeout_s=5)
        finally:
            timer.cancel()


def test_wait_ready_times_out_when_nothing_listens():
    with (
        grpc.insecure_channel(f"127.0.0.1:{closed_port()}") as channel,
        pytest.raises(TimeoutError, match=SERVICE_NAME),
    ):
        wait_ready(channel, timeout_s=0.3)
