"""The committed generated code matches the .proto files, and messages round-trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from proto.baton.v1 import inference_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generate_request_round_trips_with_unset_optionals():
    req = pb.GenerateRequest(
        request_id="r1",
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=pb.SamplingParams(temperature=0.0, seed=7),
        stopping=pb.StoppingCriteria(max_tokens=16, stop=["\n\n"]),
        disaggregation=pb.DISAGGREGATION_NEVER,
    )
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("prompt") == "token_ids"
    # proto3 `optional`: an explicit 0 is distinguishable from unset.
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")
    assert not back.stopping.HasField("min_tokens")


def test_response_oneof():
    final = pb.GenerateResponse(
        request_id="r1",
        final=pb.Final(finish_reason=pb.FINISH_REASON_STOP, stop_string="END"),
    )
    assert final.WhichOneof("kind") == "final"
    assert final.final.WhichOneof("stop_reason") == "stop_string"
