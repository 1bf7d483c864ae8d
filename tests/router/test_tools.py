"""Tool calling on the HTTP front end (router/http/tools.py), over the router's real flow.

What must hold: a named or required tool choice sends the worker the constraint that
forces a call (the function's parameters, or an array of calls, one schema per tool);
the output comes back as OpenAI's ``tool_calls`` (whole, and streamed as the official
client accumulates it); ``auto`` reads the template's own format and is refused where
the template cannot show the model its tools; earlier calls and their results reach the
template with their arguments as objects; refusals name the field. The scripted workers
"generate" the text each test sets; tests/workers/test_structured_output.py and
tests/router/test_structured_flow.py show real engines keeping to the constraints.
"""

from __future__ import annotations

import json

import openai
import pytest

from cluster.tools.families import LLAMA3_CHAT_TEMPLATE
from cluster.tools.make_model import build_tokenizer
from router.http.chat_template import ChatTemplate
from router.http.schemas import ChatCompletionRequest
from router.http.tools import template_message, tool_calling
from tests.router.http_harness import serve
from tests.router.test_typed_flow import make_router
from workers.text.tokenizer import Tokenizer

PLAIN = ChatTemplate(LLAMA3_CHAT_TEMPLATE, {"bos_token": "<|begin_of_text|>"})
# A Hermes-style template (Qwen 2.5's shape, shortened): tools in the system turn, calls
# as <tool_call> blocks, results as tool turns.
HERMES = ChatTemplate(
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t.function.name }}: "
    "{{ t.function.description }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    '{% for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


def answering(tokenizer, text: str, template=HERMES):
    """A served router whose workers 'generate' ``text`` (then over again)."""
    parts = make_router(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    parts[1].output_ids = parts[2].output_ids = ids
    return serve(parts, chat_template=template), len(ids)


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def test_a_named_choice_is_the_functions_arguments_whole_and_streamed(tokenizer):
    arguments = '{"city": "Paris"}'
    served, n = answering(tokenizer, arguments)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with served as s:
        c = client(s)
        out = c.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=n
        )
        sent = s.decode.items[-1].params.structured
        stream = c.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=n,
            stream=True,
        )
        chunks = list(stream)
    (call,) = out.choices[0].message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    assert out.choices[0].message.content is None
    # The worker was sent the function's parameters as the constraint.
    assert sent.kind == "json_schema"
    compact = {"x-guidance": {"whitespace_flexible": False}}  # written as compact JSON
    assert json.loads(sent.spec) == WEATHER["function"]["parameters"] | compact
    # Streamed: the id and name first, then the arguments piece by piece.
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == arguments
    assert len(deltas) > 2  # it streamed, not held


def test_required_calls_come_whole_with_one_schema_per_tool(tokenizer):
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    served, n = answering(tokenizer, text)
    with served as s:
        c = client(s)
        ask = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
        out = c.chat.completions.create(**ask, max_tokens=n)
        sent = s.decode.items[-1].params.structured
        chunks = list(c.chat.completions.create(**ask, max_tokens=n, stream=True))
        c.chat.completions.create(**ask, max_tokens=n, parallel_tool_calls=False)
        single = json.loads(s.decode.items[-1].params.structured.spec)
    calls = out.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    schema = json.loads(sent.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert (
        schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    )
    assert single["maxItems"] == 1
    streamed = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in streamed] == [(0, "get_weather"), (1, "get_time")]
    assert [d.function.arguments for d in streamed] == [c.function.arguments for c in calls]


def test_auto_reads_hermes_blocks_and_keeps_the_rest_as_content(tokenizer):
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    served, n = answering(tokenizer, text)
    with served as s:
        out = client(s).chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER], max_tokens=n
        )
        sent = s.decode.items[-1].params.structured
    message = out.choices[0].message
    assert sent is None  # auto: unconstrained, the model decides
    assert message.content == "Let me look."
    (call,) = message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_without_a_call_is_plain_content_and_streams(tokenizer):
    served, n = answering(tokenizer, "It is sunny today in the city.")
    with served as s:
        c = client(s)
        out = c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=n)
        chunks = list(
            c.chat.completions.create(
                model="tiny", messages=ASK, tools=[WEATHER], max_tokens=n, stream=True
            )
        )
    assert out.choices[0].message.content == "It is sunny today in the city."
    assert out.choices[0].message.tool_calls is None
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices[0].delta.content]
    assert "".join(pieces) == "It is sunny today in the city."
    assert len(pieces) > 3  # streamed as it came, not held for a call that never came


def test_auto_streams_the_text_before_a_call_then_the_call_whole(tokenizer):
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    served, n = answering(tokenizer, text)
    with served as s:
        chunks = list(
            client(s).chat.completions.create(
                model="tiny", messages=ASK, tools=[WEATHER], max_tokens=n, stream=True
            )
        )
    deltas = [ch.choices[0].delta for ch in chunks]
    content = "".join(d.content or "" for d in deltas)
    assert content.strip() == "Let me look." and "<tool" not in content
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert any(d.content for d in deltas[:first_call])  # the text went out before the call
    (call,) = deltas[first_call].tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize(
    ("parser", "pieces", "content", "names"),
    [
        (
            "hermes",
            ["Hi <tool", "_ca", "ll>", '{"name": "t", "arguments": {}}</tool_call>'],
            "Hi ",
            ["t"],
        ),
        ("hermes", ["a <to", "ast>"], "a <toast>", []),  # a tag's start that was not one
        ("json", ["  ", '{"name": "t", ', '"parameters": {"x": 1}}'], "", ["t"]),
        ("json", [" ", "Sure", "{"], " Sure{", []),
    ],
)
def test_auto_stream_holds_only_what_may_be_a_call(parser, pieces, content, names):
    from router.http.tools import AutoStream, ToolCalling

    stream = AutoStream(ToolCalling("auto", ("t",), parser))
    out = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    assert out + rest == content
    assert [c.name for c in calls] == names


def test_a_round_trip_renders_the_tools_the_call_and_its_result(tokenizer):
    body = ChatCompletionRequest(
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
        ],
        tools=[WEATHER],
    )
    calling, forced, tools = tool_calling(body, HERMES)
    assert calling.mode == "auto" and calling.parser == "hermes" and forced is None
    messages = [
        template_message(m.model_dump(exclude_none=True) | {"content": m.content or ""})
        for m in body.messages
    ]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = HERMES.render(messages, tools=tools)
    assert "Tools:get_weather: The weather in a city<|im_end|>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\n18 C, clear<|im_end|>" in text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "does not render tools"),
        ({"tool_choice": "required", "tools": []}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "no tool named 'nope'",
        ),
        (
            {"tools": [WEATHER, WEATHER], "tool_choice": "required"},
            "tools[1].function.name",
            "twice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "a b"}}],
                "tool_choice": "required",
            },
            "tools[0].function.name",
            "letters, digits",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined with response_format",
        ),
    ],
)
def test_refusals_name_the_field(tokenizer, extra, param, words):
    served, _ = answering(tokenizer, "x", template=PLAIN)
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER], **extra}
    with served as s, pytest.raises(openai.BadRequestError) as refused:
        client(s).chat.completions.create(**body)
    assert refused.value.body["param"] == param, refused.value.body
    assert words in refused.value.body["message"]
