"""The gRPC forms of the CLI (``baton generate --target``, ``baton status``) against the
fake router (tests/cluster/fake_router.py)."""

import io
import json

import pytest
from google.protobuf import json_format

from cluster import cli
from cluster.client import (
    format_status,
)
from proto.baton.v1 import inference_pb2 as pb

from .fake_router import STATUS, closed_port

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
    argv += ["--disaggregation", "never", "--no-speculative", "--timing", "Hi"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "usage: 4 prompt tokens (2 cached), 4 completion tokens" in err
    assert "kv transfer 2.0 ms (3.0 MiB)" in err and "decode decode-0" in err
    (received,) = server.servicer.requests
    assert received == pb.GenerateRequest(
        text="Hi",
        sampling=pb.SamplingParams(temperature=0.0, top_k=40, speculative=False),
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
    assert cli.main(["generate", "--target", f"127.0.0.1:{closed_port()}", "Hi"]) == 1
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
    target = f"127.0.0.1:{closed_port()}"
    assert cli.main(["status", "--target", target, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"baton: error: cannot reach a Baton router at {target} (UNAVAILABLE")
