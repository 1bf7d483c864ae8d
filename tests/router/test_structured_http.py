"""Structured outputs through both front ends, as far as the router goes: each way a
client may ask (OpenAI's ``response_format``; vLLM's ``guided_*`` and
``structured_outputs``; gRPC's ``structured``) reaches the worker as the same
``SamplingParams.structured``, and a constraint the engine could not compile, or two at
once, is refused before admission naming the field and the part of the schema. Real
engines keeping to the constraints: tests/router/test_structured_flow.py.
"""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from cluster.tools.families import LLAMA3_CHAT_TEMPLATE
from cluster.tools.make_model import build_tokenizer
from proto.baton.v1 import inference_pb2 as pb
from proto.baton.v1 import inference_pb2_grpc as pb_grpc
from router.http.chat_template import ChatTemplate
from tests.router.fuzz_harness import serve_grpc
from tests.router.http_harness import serve
from tests.router.test_typed_flow import PROMPT, make_router
from workers.protocol.structured_output import StructuredOutput
from workers.text.tokenizer import Tokenizer

TEMPLATE = ChatTemplate(LLAMA3_CHAT_TEMPLATE, {"bos_token": "<|begin_of_text|>"})
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
BAD = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(a)\\1"}}}
ASK = [{"role": "user", "content": "Who?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


@pytest.fixture(scope="module")
def served(tokenizer):
    with serve(make_router(tokenizer), chat_template=TEMPLATE) as s:
        yield s


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def fmt(schema, strict=None) -> dict:
    spec = {"name": "person", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"response_format": fmt(SCHEMA, True)}, StructuredOutput.json_schema(SCHEMA)),
        # OpenAI's default is not strict: keywords the engine cannot enforce are ignored.
        ({"response_format": fmt(SCHEMA)}, StructuredOutput.json_schema(SCHEMA, strict=False)),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_regex": "[0-9]{3}"}, StructuredOutput("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", choices=("yes", "no"))),
        ({"guided_grammar": 'start: "a"+'}, StructuredOutput("grammar", 'start: "a"+')),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_way_of_asking_reaches_the_worker_alike(served, extra, want, endpoint):
    c = client(served)
    if endpoint == "chat":
        c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body=extra)
    else:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=extra)
    sent = served.decode.items[-1].params.structured
    if want is not None and want.kind == "json_schema":  # the same schema, in any spelling
        assert (sent.kind, sent.strict) == (want.kind, want.strict)
        assert json.loads(sent.spec) == json.loads(want.spec)
    else:
        assert sent == want


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": fmt(BAD, True)},
            "response_format",
            "at /properties/code: regex parse error",
        ),
        ({"guided_regex": "(a)\\1"}, "guided_regex", "backreferences are not supported"),
        ({"guided_choice": []}, "guided_choice", "at least one string"),
        ({"guided_json": "{not json"}, "guided_json", "is not JSON"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "one output constraint per request, got response_format, guided_regex",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ],
)
def test_refusals_name_the_field_and_the_part(served, extra, param, words):
    c = client(served)
    before = len(served.decode.items)
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body=extra)
    body = refused.value.body
    assert body["param"] == param, body
    assert body["message"].startswith(param + ": ") and words in body["message"], body
    assert len(served.decode.items) == before  # refused before any worker saw it


def test_grpc_structured_reaches_the_worker_and_a_bad_one_is_refused(tokenizer):
    router, _, decode, _ = make_router(tokenizer)
    with serve_grpc(router) as s, grpc.insecure_channel(s.target) as ch:
        stub = pb_grpc.InferenceStub(ch)

        def ask(structured: pb.StructuredOutput) -> list:
            req = pb.GenerateRequest(text=PROMPT, structured=structured)
            req.stopping.max_tokens = 2
            return list(stub.Generate(req))

        ask(pb.StructuredOutput(json_schema=json.dumps(SCHEMA), lenient=True))
        assert decode.items[-1].params.structured == StructuredOutput(
            "json_schema", json.dumps(SCHEMA), strict=False
        )
        ask(pb.StructuredOutput(choice=pb.Choices(choices=["a", "b"])))
        assert decode.items[-1].params.structured == StructuredOutput("choice", choices=("a", "b"))
        ask(pb.StructuredOutput())  # empty: no constraint
        assert decode.items[-1].params.structured is None
        for structured, words in [
            (pb.StructuredOutput(regex="(a)\\1"), "structured: structured output (regex)"),
            (pb.StructuredOutput(regex="a", lenient=True), "structured.lenient: applies to"),
            (pb.StructuredOutput(json_object=False), "structured.json_object: true"),
            (pb.StructuredOutput(json_schema="[1]"), "structured.spec: (json_schema) must be"),
        ]:
            with pytest.raises(grpc.RpcError) as refused:
                ask(structured)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(words), refused.value.details()
