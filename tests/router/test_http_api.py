"""The HTTP front end (router/http/) over the router's real flow and scripted workers,
driven by the official ``openai`` client and, for the wire format, raw HTTP.

What must hold: answers and streams are OpenAI's (chunks, ``[DONE]``, usage, ``n``),
choices are the router's output for the same typed request, refusals carry OpenAI's
status and name the OpenAI field, and a client that goes away aborts its request on
the worker. tests/e2e/test_openai_api.py repeats the main paths on a real cluster.
"""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest
from prometheus_client import REGISTRY

from cluster.tools.families import LLAMA3_CHAT_TEMPLATE
from cluster.tools.make_model import build_tokenizer
from router.auth import ApiKeys, Principal
from router.http.chat_template import ChatTemplate
from tests.router.http_harness import endless_router, serve
from tests.router.test_typed_flow import OUTPUT, PROMPT, make_router
from workers.text.tokenizer import Tokenizer

TEMPLATE = ChatTemplate(LLAMA3_CHAT_TEMPLATE, {"bos_token": "<|begin_of_text|>"})


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


@pytest.fixture(scope="module")
def served(tokenizer):
    with serve(
        make_router(tokenizer, workers={"with_logprobs": True}), chat_template=TEMPLATE
    ) as s:
        yield s


def client(served, **kw) -> openai.OpenAI:
    # No retries: a 429 or 503 is what these tests look for.
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, **kw)


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a streamed answer; checks the framing on the way."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def test_completion_is_the_routers_output_with_usage(served, tokenizer):
    out = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0
    )
    assert out.object == "text_completion" and out.model == "tiny"
    [choice] = out.choices
    assert choice.text == tokenizer.decode(served.output_ids[:6])
    assert choice.finish_reason == "length"
    prompt_len = len(tokenizer.encode(PROMPT))
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == prompt_len + 6
    assert served.decode.items[-1].params.max_tokens == 6


def test_completions_default_to_16_tokens_as_openai(served):
    out = client(served).completions.create(model="tiny", prompt=PROMPT)
    assert out.usage.completion_tokens == 16


def test_streamed_completion_with_usage(served, tokenizer):
    stream = client(served).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1])
    *texts, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in texts) == tokenizer.decode(served.output_ids[:5])
    assert [c.choices[0].finish_reason for c in texts][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_stream_wire_format_is_openais(served):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    response = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(response)[:-1]]
    assert all("usage" not in e for e in events)  # only with include_usage
    assert {e["object"] for e in events} == {"text_completion"}


def test_n_choices_with_seeds_and_a_prompt_batch(served):
    out = client(served).completions.create(
        model="tiny", prompt=[PROMPT, "Hello"], max_tokens=3, n=2, seed=7, temperature=0.8
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    seeds = sorted(item.params.seed for item in served.decode.items[-4:])
    assert seeds == [7, 7, 8, 8]  # choice i of each prompt samples with seed + i
    assert out.usage.completion_tokens == 12


def test_metrics_count_each_choice_under_the_http_front_end(served):
    def finished(frontend: str) -> float:
        labels = {"role": "router", "model": "tiny", "instance": "router", "frontend": frontend}
        value = REGISTRY.get_sample_value(
            "baton_requests_finished_total", {**labels, "finish_reason": "length"}
        )
        return value or 0.0

    def rejected() -> float:
        labels = {"role": "router", "model": "tiny", "instance": "router", "frontend": "http"}
        value = REGISTRY.get_sample_value(
            "baton_requests_rejected_total", {**labels, "code": "INVALID_ARGUMENT"}
        )
        return value or 0.0

    before = finished("http"), finished("grpc"), rejected()
    client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=3)
    assert (finished("http") - before[0], finished("grpc") - before[1]) == (3, 0)
    # Refused by pydantic, by the adapter (model), by the router (top_p): each counted once.
    for body in ({"prompt": 5}, {"prompt": "x", "model": "other"}, {"prompt": "x", "top_p": 9}):
        assert httpx.post(served.url + "/v1/completions", json=body, timeout=30).status_code >= 400
    assert rejected() - before[2] == 3


def test_echo_prepends_the_prompt(served, tokenizer):
    out = client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True)
    assert out.choices[0].text == PROMPT + tokenizer.decode(served.output_ids[:2])


def test_completion_logprobs_are_the_workers(served, tokenizer):
    out = client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [-0.5, -0.5, -0.5]
    assert lp.tokens == [tokenizer.decode([t]) for t in served.output_ids[:3]]
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_renders_the_template_and_streams(served, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client(served).chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=4, logprobs=True, top_logprobs=1
    )
    rendered = TEMPLATE.render(messages)
    assert served.decode.items[-1].prompt_token_ids == tuple(
        tokenizer.encode(rendered, add_special_tokens=False)
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == tokenizer.decode(served.output_ids[:4])
    assert [t.logprob for t in out.choices[0].logprobs.content] == [-0.5] * 4
    stream = client(served).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_choice(served):
    stop = OUTPUT.split()[2]  # "a"
    out = client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=20, stop=[stop])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert choice.model_extra["stop_reason"] == stop


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"top_p": 7}, "top_p", "top_p must be in (0, 1]"),
        ({"top_p": "high"}, "top_p", "valid number"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"temperature": -1}, "temperature", "non-negative"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"stop": [1, 2]}, "stop", ""),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": "x" * 300}, "prompt", "max_model_len"),
        ({"max_tokens": 250}, "max_tokens", "max_model_len"),
        ({"suffix": "tail"}, "suffix", "not supported"),
        ({"disaggregation": "sometimes"}, "disaggregation", ""),
        ({"speculative": "no"}, "speculative", "boolean"),
    ],
)
def test_bad_fields_are_400_naming_the_openai_field(served, body, param, needle):
    response = httpx.post(
        served.url + "/v1/completions", json={"prompt": PROMPT, **body}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}")
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_speculative_extra_reaches_the_workers_sampling_params(served):
    """Baton's ``speculative`` body field, on both endpoints: false opts the request out;
    left out, the decode pool's setting applies (SamplingParams' default, True)."""
    url = served.url
    for extra, expected in (
        ({}, True),
        ({"speculative": False}, False),
        ({"speculative": True}, True),
    ):
        body = {"prompt": PROMPT, "max_tokens": 2, **extra}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert served.decode.items[-1].params.speculative is expected, extra
    client(served).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"speculative": False},
    )
    assert served.decode.items[-1].params.speculative is False


def test_chat_field_names(served):
    c = client(served)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 300}], max_tokens=1
        )
    assert info.value.body["param"] == "messages"
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0
        )
    assert info.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}])
    assert info.value.body["param"] == "messages[0].role"


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b"{not json", {"content-type": "application/json"}),
        (b"[1, 2]", {"content-type": "application/json"}),
        (b"\xff\xfe", {"content-type": "application/json"}),
        (b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    ],
)
def test_malformed_bodies_are_400_and_the_server_keeps_serving(served, content, headers):
    response = httpx.post(
        served.url + "/v1/completions", content=content, headers=headers, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200


def test_unknown_fields_are_ignored(served):
    body = {"prompt": PROMPT, "max_tokens": 2, "a_field_from_the_future": {"x": 1}}
    response = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200


def test_unknown_model_is_404_and_models_lists_the_served_one(served):
    c = client(served)
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="gpt-4", prompt=PROMPT)
    assert info.value.body["code"] == "model_not_found"
    assert [m.id for m in c.models.list()] == ["tiny"]


def test_health_and_version(served):
    assert httpx.get(served.url + "/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(served.url + "/version", timeout=30).json()["version"]
    assert httpx.get(served.url + "/v1/nothing", timeout=30).status_code == 404


def test_no_chat_template_is_a_clear_400(tokenizer):
    with serve(make_router(tokenizer)) as s, pytest.raises(openai.BadRequestError) as info:
        client(s).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
    assert "no chat template" in info.value.body["message"]


def test_api_key_is_required_on_v1_only(tokenizer):
    keys = ApiKeys([("s3cret-0123456789", Principal("a", "a"))])
    with serve(make_router(tokenizer), keys=keys) as s:
        for key in ("wrong", "s3cret-012345678", "s3cret-0123456789-and-more"):
            with pytest.raises(openai.AuthenticationError) as info:
                openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0).models.list()
            assert info.value.status_code == 401
        no_header = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert no_header.status_code == 401
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret-0123456789", max_retries=0)
        assert c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200


def test_body_over_the_limit_is_413(tokenizer):
    with serve(make_router(tokenizer), max_body_bytes=1000) as s:
        big = {"prompt": "x" * 2000}
        assert httpx.post(s.url + "/v1/completions", json=big, timeout=30).status_code == 413

        def chunked():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        response = httpx.post(
            s.url + "/v1/completions",
            content=chunked(),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        small = {"prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=small, timeout=30).status_code == 200


def test_queue_full_is_429_and_draining_is_503(tokenizer):
    with serve(endless_router(tokenizer, max_queued_requests=1)) as s:
        c = client(s)
        with c.completions.create(model="tiny", prompt=PROMPT, stream=True) as first:
            next(iter(first))  # admitted and streaming: the queue is full
            with pytest.raises(openai.RateLimitError) as info:
                c.completions.create(model="tiny", prompt=PROMPT)
            assert info.value.status_code == 429
        s.wait_settled()  # closing the stream aborted it
        s.call(lambda: s.router.drain(0))
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model="tiny", prompt=PROMPT)
        assert info.value.status_code == 503
        assert httpx.get(s.url + "/health", timeout=30).status_code == 503


def test_a_client_that_disconnects_mid_stream_aborts_its_request(tokenizer):
    with serve(endless_router(tokenizer)) as s:
        body = {"prompt": PROMPT, "stream": True, "max_tokens": 100}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        s.wait_settled()
        [item] = [i for i in s.decode.items if i.mode == "decode"]
        assert s.decode.aborted == [item.request_id]


def test_a_client_that_gives_up_on_a_whole_answer_aborts_its_request(tokenizer):
    with serve(endless_router(tokenizer)) as s:
        c = client(s, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=100)
        s.wait_settled()
        [item] = [i for i in s.decode.items if i.mode == "decode"]
        assert s.decode.aborted == [item.request_id]
