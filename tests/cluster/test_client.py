"""cluster.client and the gRPC forms of the CLI, against a fake servicer on loopback.

The fake stands in for router/server.py: it records each request, streams two Deltas
and a Final, and answers errors the way §2.3 says the real one does.
"""

import io
import json
import socket
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

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
from proto.baton.v1 import inference_pb2_grpc as pb_grpc

STATUS = pb.ClusterStatus(
    model="tiny-llama",
    kv_transfer_backend="local",
    policy="kv_aware",
    disaggregation="auto",
    draining=False,
    pools=[
        pb.PoolStatus(
            role="prefill",
            replicas=1,
            healthy_replicas=1,
            workers=[
                pb.WorkerStatus(
                    name="prefill-0",
                    role="prefill",
                    healthy=True,
                    tensor_parallel=2,
                    pipeline_parallel=1,
                    num_running=3,
                    num_waiting=1,
                    kv_blocks_total=1024,
                    kv_blocks_used=128,
                    kv_blocks_cached=256,
                )
            ],
        ),
        pb.PoolStatus(
            role="decode",
            replicas=2,
            healthy_replicas=1,
            workers=[
                pb.WorkerStatus(
                    name="decode-0",
                    role="decode",
                    healthy=True,
                    tensor_parallel=1,
                    pipeline_parallel=1,
                    num_running=17,
                    kv_blocks_total=400,
                    kv_blocks_used=100,
                ),
                pb.WorkerStatus(name="decode-1", role="decode", healthy=False),
            ],
        ),
    ],
)
TIMING = pb.Timing(
    queue_seconds=0.001,
    prefill_seconds=0.012,
    kv_transfer_seconds=0.002,
    kv_transfer_bytes=3 * 1024 * 1024,
    ttft_seconds=0.02,
    e2e_seconds=0.25,
    prefill_worker="prefill-0",
    decode_worker="decode-0",
)


class FakeInference(pb_grpc.InferenceServicer):
    """Records requests; prompts steer it: '' is invalid, 'slow' waits to be cancelled."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        self.requests.append(request)
        if request.WhichOneof("prompt") is None or request.text == "":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: the prompt is empty")
        if request.text == "busy":
            context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode workers")
        if request.text == "slow":
            context.add_callback(self.cancelled.set)
            yield pb.GenerateResponse(request_id="r-slow", delta=pb.Delta(token_ids=[1], text="a"))
            self.cancelled.wait(10)
            return
        yield pb.GenerateResponse(request_id="r1", delta=pb.Delta(token_ids=[5], text="Hello"))
        yield pb.GenerateResponse(request_id="r1", delta=pb.Delta(token_ids=[6, 7], text=", wor"))
        final = pb.Final(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=4, completion_tokens=4, cached_prompt_tokens=2),
            delta=pb.Delta(token_ids=[8], text="ld"),
        )
        if request.output.return_timing:
            final.timing.CopyFrom(TIMING)
        yield pb.GenerateResponse(request_id="r1", final=final)

    def GetClusterStatus(self, request, context):
        return STATUS


@dataclass
class FakeServer:
    target: str
    servicer: FakeInference
    health: health.HealthServicer


@pytest.fixture
def server():
    servicer = FakeInference()
    health_servicer = health.HealthServicer()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_InferenceServicer_to_server(servicer, grpc_server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield FakeServer(f"127.0.0.1:{port}", servicer, health_servicer)
    servicer.cancelled.set()  # release a 'slow' handler a failed test left waiting
    grpc_server.stop(grace=None)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel)


def _closed_port() -> int:
    # Bound then closed: nothing listens there, so a connection is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    for name in ("top_p", "top_k", "seed", "min_p"):
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
        *("prefill-0", "prefill", "yes", "2", "1", "3", "1"),
        *("128", "(12.5%)", "256", "(25.0%)", "1024"),
    ]
    (sick_row,) = [line for line in lines if "decode-1" in line]
    assert sick_row.split() == [
        *("decode-1", "decode", "NO", "0", "0", "0", "0"),
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
        grpc.insecure_channel(f"127.0.0.1:{_closed_port()}") as channel,
        pytest.raises(TimeoutError, match=SERVICE_NAME),
    ):
        wait_ready(channel, timeout_s=0.3)


# ---- baton generate --target ----------------------------------------------------------


def test_cli_generate_streams_text(server, capsys):
    assert cli.main(["generate", "--target", server.target, "Hi"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello, world\n"
    assert "4 tokens, finish: length" in captured.err
    assert "timing" not in captured.err
    (received,) = server.servicer.requests
    assert received == pb.GenerateRequest(text="Hi")  # no flag, no field


def test_cli_generate_sets_exactly_the_flags_given(server, capsys):
    argv = ["generate", "--target", server.target, "--max-tokens", "12"]
    argv += ["--temperature", "0", "--top-k", "40", "--stop", "\n\n", "--stop", "END"]
    argv += ["--disaggregation", "never", "--timing", "Hi"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "usage: 4 prompt tokens (2 cached), 4 completion tokens" in err
    assert "kv transfer 2.0 ms (3.0 MiB)" in err and "decode decode-0" in err
    (received,) = server.servicer.requests
    assert received == pb.GenerateRequest(
        text="Hi",
        sampling=pb.SamplingParams(temperature=0.0, top_k=40),
        stopping=pb.StoppingCriteria(max_tokens=12, stop=["\n\n", "END"]),
        output=pb.OutputOptions(return_timing=True),
        disaggregation=pb.DISAGGREGATION_NEVER,
    )
    assert received.sampling.HasField("temperature")
    assert not received.sampling.HasField("top_p") and not received.sampling.HasField("seed")


def test_cli_generate_reads_stdin(server, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    argv = ["generate", "--target", server.target, "--seed", "3", "--ignore-eos", "-"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "Hello, world\n"
    (received,) = server.servicer.requests
    assert received == pb.GenerateRequest(
        text="from stdin",
        sampling=pb.SamplingParams(seed=3),
        stopping=pb.StoppingCriteria(ignore_eos=True),
    )


@pytest.mark.parametrize(
    ("prompt", "code", "message"),
    [
        ("", 2, "baton: error: INVALID_ARGUMENT: text: the prompt is empty"),
        ("busy", 1, "baton: error: UNAVAILABLE: no healthy decode workers"),
    ],
)
def test_cli_generate_grpc_errors(server, capsys, prompt, code, message):
    assert cli.main(["generate", "--target", server.target, prompt]) == code
    captured = capsys.readouterr()
    assert captured.err.strip() == message
    assert captured.out == ""


def test_cli_generate_unreachable(capsys):
    assert cli.main(["generate", "--target", f"127.0.0.1:{_closed_port()}", "Hi"]) == 1
    assert capsys.readouterr().err.startswith("baton: error: UNAVAILABLE: ")


class _InterruptingStdout:
    """Stands in for a terminal where Ctrl-C lands while the first delta is printed."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def write(self, text: str) -> int:
        self.written.append(text)
        if len(self.written) == 1:
            raise KeyboardInterrupt
        return len(text)

    def flush(self) -> None:
        pass


def test_cli_generate_ctrl_c_cancels_the_call(server, capsys, monkeypatch):
    stdout = _InterruptingStdout()
    monkeypatch.setattr("sys.stdout", stdout)
    assert cli.main(["generate", "--target", server.target, "slow"]) == 130
    assert "interrupted" in capsys.readouterr().err
    # The server saw the RPC end long before its handler's 10 s wait ran out.
    assert server.servicer.cancelled.wait(5)
    assert stdout.written == ["a", "\n"]


# ---- baton status ---------------------------------------------------------------------


def test_cli_status_table(server, capsys):
    assert cli.main(["status", "--target", server.target]) == 0
    out = capsys.readouterr().out
    assert out == format_status(STATUS) + "\n"
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert name in out


def test_cli_status_json(server, capsys):
    assert cli.main(["status", "--target", server.target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert json_format.ParseDict(data, pb.ClusterStatus()) == STATUS
    assert data["draining"] is False  # defaults are printed, not dropped
    assert data["pools"][1]["workers"][1]["kv_blocks_used"] == 0


def test_cli_status_unreachable(capsys):
    target = f"127.0.0.1:{_closed_port()}"
    assert cli.main(["status", "--target", target, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"baton: error: cannot reach a Baton router at {target} (UNAVAILABLE")
