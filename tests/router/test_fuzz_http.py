"""Fuzzing the HTTP front end (issue 25): generated bodies for ``/v1/completions`` and
``/v1/chat/completions`` (wrong types, extreme and non-finite numbers, 1 MB strings, token
ids out of range, stop lists of thousands, nested junk) and raw bodies (random and invalid
UTF-8 bytes, lone surrogates, empty, wrong content type) against the real app under
uvicorn on a loopback port and the real router (scripted workers behind it, work items
through the real wire codec; tests/router/fuzz_harness.py).

The property: every answer is a valid one (200, choices, or an event stream ending with
``[DONE]``) or a clear refusal: a 4xx with OpenAI's error object whose message starts with
the ``param`` it names (or says what is wrong with the body as a whole); 429 names
``router.max_queued_requests``. Never a 5xx or a dropped connection; afterwards a normal
request still succeeds and nothing is left in flight. Bugs it found are pinned with
``@example``.
"""

from __future__ import annotations

import json
import math

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.tools.families import LLAMA3_CHAT_TEMPLATE
from cluster.tools.make_model import build_tokenizer
from router.http.chat_template import ChatTemplate
from tests.router.fuzz_harness import FIELD_FIRST, Counter, examples, fuzz_router
from tests.router.http_harness import serve
from workers.text.tokenizer import Tokenizer

VOCAB = 512
MIB = 2**20
TEMPLATE = ChatTemplate(LLAMA3_CHAT_TEMPLATE, {"bos_token": "<|begin_of_text|>"})
JSON = {"content-type": "application/json"}
_SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@pytest.fixture(scope="module")
def served():
    tokenizer = Tokenizer(build_tokenizer("llama", VOCAB), 0, frozenset({1, 2}))
    router = fuzz_router(tokenizer)
    parts = (router, router.prefill[0].client, router.decode[0].client, [])
    with serve(parts, chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


# ---- strategies --------------------------------------------------------------------------

BIG_INTS = st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**70, -(2**63) - 1, 10**300, -1, 0])
INTS = st.integers(-5, 300) | BIG_INTS
FLOATS = st.floats() | st.sampled_from([1e308, -1e308, 5e-324, 1e400]) | INTS
HUGE_TEXT = st.sampled_from(["a" * MIB, "\U0001f600" * (MIB // 4), "stop " * (MIB // 5)])
TEXT = st.text(max_size=40) | HUGE_TEXT
JUNK = st.recursive(
    st.none() | st.booleans() | FLOATS | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
TOKEN_IDS = st.lists(st.integers(-3, VOCAB + 3) | BIG_INTS, max_size=200) | st.lists(
    st.integers(0, VOCAB - 1), min_size=250, max_size=5000
)
PROMPT = (
    TEXT
    | TOKEN_IDS
    | st.lists(TEXT, max_size=8)
    | st.lists(TOKEN_IDS, max_size=8)
    | st.lists(st.text(max_size=5), min_size=100, max_size=400)  # a batch past the queue
)
STOP = (
    st.text(max_size=300)
    | st.lists(st.text(max_size=300), max_size=20)
    | st.lists(st.text(max_size=3), min_size=1000, max_size=3000)
)
# Field -> values of the right type (extreme ones included).
COMMON = {
    "model": st.sampled_from(["tiny"]) | TEXT,
    "n": INTS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": STOP,
    "seed": INTS,
    "temperature": FLOATS,
    "top_p": FLOATS,
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "user": TEXT,
    "top_k": INTS,
    "min_p": FLOATS,
    "repetition_penalty": FLOATS,
    "ignore_eos": st.booleans(),
    "min_tokens": INTS,
    "stop_token_ids": st.lists(INTS, max_size=20) | st.lists(INTS, min_size=1000, max_size=3000),
    "disaggregation": st.sampled_from(["always", "never", "auto"]) | TEXT,
    "max_tokens": INTS,
}
COMPLETION = {
    **COMMON,
    "prompt": PROMPT,
    "logprobs": INTS,
    "echo": st.booleans(),
    "suffix": TEXT,
    "best_of": INTS,
    "logit_bias": st.dictionaries(st.text(max_size=5), FLOATS, max_size=3),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | TEXT},
    optional={
        "content": TEXT
        | st.none()
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3),
        "name": TEXT,
    },
)
CHAT = {
    **COMMON,
    "messages": st.lists(MESSAGE, max_size=4),
    "max_completion_tokens": INTS,
    "logprobs": st.booleans(),
    "top_logprobs": INTS,
    "tools": st.lists(st.dictionaries(st.text(max_size=5), JUNK, max_size=2), max_size=2),
    "response_format": st.dictionaries(st.text(max_size=5), JUNK, max_size=2)
    | st.just({"type": "text"}),
    "add_generation_prompt": st.booleans(),
}


@st.composite
def bodies(draw, fields: dict, required: str) -> dict:
    """A body whose fields mostly have their type (so the router's validation is reached),
    sometimes junk of any JSON type; ``required`` is usually present."""
    body = {}
    for name, strategy in fields.items():
        if name == required and draw(st.integers(0, 9)) == 0:
            continue  # sometimes missing
        if name != required and draw(st.booleans()):
            continue  # most options unset
        body[name] = draw(JUNK) if draw(st.integers(0, 7)) == 0 else draw(strategy)
    body.update(draw(st.dictionaries(st.text(max_size=8), JUNK, max_size=2)))
    return body


@st.composite
def focused(draw, fields: dict, base: dict) -> dict:
    """A valid ``base`` body with one or two fields hostile: reaches the router's
    validation and the wire to the workers more often than :func:`bodies`."""
    names = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True))
    return {**base, **{name: draw(fields[name]) for name in names}}


def encode(body) -> bytes:
    """JSON as Python writes it: NaN and Infinity included (clients send them)."""
    return json.dumps(body, allow_nan=True).encode()


# ---- the property ------------------------------------------------------------------------


def check_answer(response: httpx.Response) -> int:
    """Fail unless ``response`` is a valid answer or a clear refusal; its status."""
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    if status == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
        else:
            assert response.json()["choices"], response.text[:300]
        return status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    message, param = error["message"], error["param"]
    assert isinstance(message, str) and len(message) < 2000, "echoes the input at length"
    if status == 400:
        if param is not None:
            assert message.startswith(f"{param}: "), error
        else:  # the body as a whole, or the router's field path
            assert message.startswith(("the body", "Content-Length")) or FIELD_FIRST.match(
                message
            ), error
    elif status == 429:
        assert "router.max_queued_requests" in message, error
    else:
        assert status in (404, 413), error
    return status


def normal_request_succeeds(client) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4


def test_completion_bodies_get_an_answer_or_a_clear_refusal(served, client):
    count = Counter("http_completions")

    @settings(max_examples=examples(60), **_SETTINGS)
    @given(
        body=bodies(COMPLETION, "prompt") | focused(COMPLETION, {"prompt": "hi", "max_tokens": 4})
    )
    @example(body={"prompt": [-1, 5]})  # a negative token id reached the worker
    # Past what the msgpack wire to the workers carries: the submit failed, 503.
    @example(body={"prompt": "hi", "max_tokens": 2, "top_k": 2**70})
    @example(body={"prompt": "hi", "max_tokens": None, "min_tokens": 2**70})
    @example(body={"prompt": "hi", "max_tokens": 1})  # the first token is the last
    def fuzz(body: dict) -> None:
        count()
        check_answer(client.post("/v1/completions", content=encode(body), headers=JSON))

    fuzz()
    count.flush()
    served.wait_settled()
    normal_request_succeeds(client)


def test_chat_bodies_get_an_answer_or_a_clear_refusal(served, client):
    count = Counter("http_chat")

    @settings(max_examples=examples(60), **_SETTINGS)
    @given(
        body=bodies(CHAT, "messages")
        | focused(CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    )
    def fuzz(body: dict) -> None:
        count()
        check_answer(client.post("/v1/chat/completions", content=encode(body), headers=JSON))

    fuzz()
    count.flush()
    served.wait_settled()
    normal_request_succeeds(client)


RAW = (
    st.binary(max_size=300)
    | st.sampled_from([b"", b"{", b"null", b"[]", b'"prompt"', b"\xff\xfe{}", b'{"prompt": 1e999}'])
    | st.text(max_size=50).map(lambda t: f'{{"prompt": "{t}"}}'.encode("utf-8", "surrogatepass"))
)


def test_raw_bodies_get_an_answer_or_a_clear_refusal(served, client):
    count = Counter("http_raw")

    @settings(max_examples=examples(60), **_SETTINGS)
    @given(
        data=RAW,
        route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        content_type=st.sampled_from(
            ["application/json", "text/plain", "", "application/x-www-form-urlencoded"]
        ),
    )
    @example(
        data=b'{"prompt": "\\ud800"}', route="/v1/completions", content_type="application/json"
    )
    @example(
        data=b'{"prompt": "\xed\xa0\x80"}', route="/v1/completions", content_type="application/json"
    )
    def fuzz(data: bytes, route: str, content_type: str) -> None:
        count()
        headers = {"content-type": content_type} if content_type else {}
        check_answer(client.post(route, content=data, headers=headers))

    fuzz()
    count.flush()
    served.wait_settled()
    normal_request_succeeds(client)


def test_non_finite_json_numbers_are_refused_naming_the_field(client):
    # Python's json (the app's parser) reads NaN / Infinity; the router refuses them.
    for value in (math.nan, math.inf, -math.inf):
        body = {"prompt": "hi", "max_tokens": 2, "temperature": value}
        answer = client.post("/v1/completions", content=encode(body), headers=JSON)
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "temperature"


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_prompt(client):
    count = Counter("http_token_ids")

    @settings(max_examples=examples(30), **_SETTINGS)
    @given(
        ids=st.lists(st.integers(0, VOCAB - 1), max_size=20),
        bad=st.integers(-(2**70), -1) | st.integers(VOCAB, 2**70),
        at=st.integers(0, 20),
    )
    @example(ids=[5], bad=-1, at=0)  # a negative id reached the worker
    def fuzz(ids: list[int], bad: int, at: int) -> None:
        count()
        ids.insert(at, bad)
        body = {"prompt": ids, "max_tokens": 2}
        answer = client.post("/v1/completions", content=encode(body), headers=JSON)
        assert answer.status_code == 400, answer.text[:300]
        error = answer.json()["error"]
        assert error["param"] == "prompt" and "out of vocabulary" in error["message"]

    fuzz()
    count.flush()
