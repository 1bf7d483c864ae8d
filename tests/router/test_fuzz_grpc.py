"""Fuzzing the gRPC front end (issue 25): generated ``GenerateRequest`` messages with every
field wrong or extreme, and random bytes as a serialized message, against the real
``router.server.Server`` and the real router (scripted workers behind it, work items
through the real wire codec; tests/router/fuzz_harness.py).

The property: every call ends with a Final (a valid answer) or a clear refusal:
INVALID_ARGUMENT whose message starts with the field it names, or RESOURCE_EXHAUSTED naming
``router.max_queued_requests``. Never INTERNAL, UNKNOWN, UNAVAILABLE (the workers are
healthy) or a missed deadline; afterwards a normal request still succeeds and nothing is
left in flight. Bugs it found are pinned with ``@example``.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.tools.make_model import build_tokenizer
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from tests.router.fuzz_harness import FIELD_FIRST, Counter, examples, fuzz_router, serve_grpc
from tests.router.http_harness import wait_settled
from workers.text.tokenizer import Tokenizer

VOCAB = 512
MIB = 2**20
_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * MIB),
    ("grpc.max_send_message_length", 64 * MIB),
]
_SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@pytest.fixture(scope="module")
def served():
    tokenizer = Tokenizer(build_tokenizer("llama", VOCAB), 0, frozenset({1, 2}))
    with serve_grpc(fuzz_router(tokenizer)) as s:
        yield s


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served.target, options=_OPTIONS) as ch:
        yield ch


# ---- strategies --------------------------------------------------------------------------

U32 = st.integers(0, 2**32 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
U64 = st.integers(0, 2**64 - 1)
FLOATS = st.floats(width=32) | st.sampled_from([0.0, 1.0, 0.5, -1.0, 1e-45, 3.4e38])
SMALL_U32 = st.integers(0, 300) | U32
HUGE_TEXT = st.sampled_from(["a" * MIB, "\U0001f600" * (MIB // 4), "stop" * (MIB // 4)])
TEXT = st.text(max_size=40) | HUGE_TEXT
STOP = st.lists(st.text(max_size=300), max_size=20) | st.lists(
    st.text(max_size=3), min_size=1000, max_size=3000
)
TOKEN_IDS = st.lists(st.integers(0, VOCAB + 5) | U32, max_size=300) | st.lists(
    st.integers(0, VOCAB - 1), min_size=250, max_size=20000
)


def _optional(strategy):
    return st.none() | strategy


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=draw(st.sampled_from(["", ""]) | st.text(max_size=20) | HUGE_TEXT),
        model=draw(st.sampled_from(["", "tiny"]) | TEXT),
        disaggregation=draw(st.integers(0, 3) | I32),
    )
    prompt = draw(st.sampled_from(["text", "token_ids", "none"]))
    if prompt == "text":
        req.text = draw(TEXT)
    elif prompt == "token_ids":
        req.token_ids.ids.extend(draw(TOKEN_IDS))
    sampling = {
        "temperature": FLOATS,
        "top_p": FLOATS,
        "top_k": I32,
        "min_p": FLOATS,
        "seed": U64,
        "repetition_penalty": FLOATS,
        "presence_penalty": FLOATS,
        "frequency_penalty": FLOATS,
    }
    for name, strategy in sampling.items():
        value = draw(_optional(strategy))
        if value is not None:
            setattr(req.sampling, name, value)
    for name in ("max_tokens", "min_tokens"):
        value = draw(_optional(SMALL_U32))
        if value is not None:
            setattr(req.stopping, name, value)
    req.stopping.stop.extend(draw(STOP))
    req.stopping.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB + 5) | U32)))
    req.stopping.ignore_eos = draw(st.booleans())
    logprobs = draw(_optional(st.integers(0, 25) | U32))
    if logprobs is not None:
        req.output.logprobs = logprobs
    return_text = draw(_optional(st.booleans()))
    if return_text is not None:
        req.output.return_text = return_text
    req.output.return_timing = draw(st.booleans())
    return req


# ---- the property ------------------------------------------------------------------------


def check_call(responses) -> str:
    """Consume one call; 'ok' (it ended with a Final) or the refusal's code name. Fails on
    anything that is neither."""
    try:
        messages = list(responses)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            assert FIELD_FIRST.match(details), f"refusal names no field: {details[:300]!r}"
        elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert "router.max_queued_requests" in details, details[:300]
        else:
            pytest.fail(f"{code.name}: {details[:500]!r}")
        assert len(details) < 2000, "a refusal echoes the hostile input at length"
        return code.name
    assert messages and messages[-1].HasField("final"), "the stream ended without a Final"
    assert all(m.HasField("delta") for m in messages[:-1])
    return "ok"


def normal_request_succeeds(channel) -> None:
    stub = pb_grpc.InferenceStub(channel)
    req = pb.GenerateRequest(text="Once upon a time")
    req.stopping.max_tokens = 4
    messages = list(stub.Generate(req, timeout=30))
    assert messages[-1].final.usage.completion_tokens == 4


def test_generated_messages_get_an_answer_or_a_clear_refusal(served, channel):
    stub = pb_grpc.InferenceStub(channel)
    count = Counter("grpc_messages")

    @settings(max_examples=examples(60), **_SETTINGS)
    @given(req=generate_requests())
    # A 1 MB model name was echoed into the status: trailers past 16 KiB killed the call.
    @example(req=pb.GenerateRequest(text="hi", model="m" * MIB))
    @example(req=pb.GenerateRequest(text="hi", request_id="r" * MIB))
    def fuzz(req: pb.GenerateRequest) -> None:
        count()
        check_call(stub.Generate(req, timeout=30))

    fuzz()
    count.flush()
    wait_settled(served.router)
    normal_request_succeeds(channel)


def test_random_bytes_as_a_message_are_refused_or_answered(served, channel):
    raw = channel.unary_stream(
        "/baton.v1.Inference/Generate",
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    count = Counter("grpc_bytes")

    @settings(max_examples=examples(60), **_SETTINGS)
    @given(data=st.binary(max_size=200))
    @example(data=b"\x1a\x02\xff\xfe")  # text = invalid UTF-8
    @example(data=b"\x0a\x05ab")  # request_id's length past the end
    def fuzz(data: bytes) -> None:
        count()
        check_call(raw(data, timeout=30))

    fuzz()
    count.flush()
    wait_settled(served.router)
    normal_request_succeeds(channel)
