"""Admission per caller (router/quotas.py): one key's overload leaves another key served;
refusals are 429 / RESOURCE_EXHAUSTED naming the limit, with Retry-After, and come
before the prompt is tokenized (a chat's template before it is rendered)."""

from __future__ import annotations

import openai
import pytest

from cluster.tools.families import LLAMA3_CHAT_TEMPLATE
from cluster.tools.make_model import build_tokenizer
from router.auth import ApiKeys, Principal
from router.http.chat_template import ChatTemplate
from router.quotas import QuotaConfig, QuotaExceeded, Quotas
from tests.router.http_harness import endless_router, serve
from tests.router.test_typed_flow import PROMPT
from workers.text.tokenizer import Tokenizer

A, B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
KEYS = ApiKeys([(A, Principal("a", "a")), (B, Principal("b", "b"))])


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_whole_bound_a_keys_share_and_release():
    quotas = Quotas(QuotaConfig(max_queued_requests=4, share_per_key=0.5))
    quotas.admit("a")
    quotas.admit("a")
    with pytest.raises(QuotaExceeded, match=r"key 'a' has 2 requests in flight .*share_per_key"):
        quotas.admit("a")
    quotas.admit("b")
    quotas.admit("b")
    with pytest.raises(
        QuotaExceeded, match=r"^4 requests in flight \(router.max_queued_requests=4"
    ):
        quotas.admit("c")
    quotas.release("a")
    quotas.admit("c")  # room again
    assert (quotas.total, quotas.in_flight("a"), quotas.in_flight("c")) == (4, 1, 1)


def test_a_rate_with_a_burst_and_when_to_retry():
    clock = Clock()
    quotas = Quotas(QuotaConfig(rate_per_key=2.0, burst_per_key=3), clock)
    for _ in range(3):  # the burst
        quotas.admit("a")
    with pytest.raises(QuotaExceeded, match="over 2 requests per second") as refused:
        quotas.admit("a")
    assert refused.value.retry_after_s == pytest.approx(0.5)
    quotas.admit("b")  # another key: its own bucket
    clock.now += 0.5
    quotas.admit("a")  # one token back


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


def test_one_keys_overload_leaves_another_key_served(tokenizer):
    parts = endless_router(tokenizer, max_queued_requests=4, max_queued_share_per_key=0.5)
    with serve(parts, keys=KEYS) as s:
        a = openai.OpenAI(base_url=s.url + "/v1", api_key=A, max_retries=0)
        b = openai.OpenAI(base_url=s.url + "/v1", api_key=B, max_retries=0)
        with (
            a.completions.create(model="tiny", prompt=PROMPT, stream=True) as one,
            a.completions.create(model="tiny", prompt=PROMPT, stream=True) as two,
        ):
            next(iter(one)), next(iter(two))  # a holds its share (2 of 4)
            with pytest.raises(openai.RateLimitError) as refused:
                a.completions.create(model="tiny", prompt=PROMPT)
            assert refused.value.status_code == 429
            assert "key 'a' has 2 requests in flight" in refused.value.message
            assert refused.value.response.headers["Retry-After"] == "1"
            with b.completions.create(model="tiny", prompt=PROMPT, stream=True) as theirs:
                assert next(iter(theirs)).choices  # b is still served
        s.wait_settled()
        assert s.router.quotas.total == 0  # every path released its place


def test_a_refusal_comes_before_the_tokenizer(tokenizer, monkeypatch):
    parts = endless_router(tokenizer, max_queued_requests=1)
    calls = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    with serve(parts) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
        with c.completions.create(model="tiny", prompt=PROMPT, stream=True) as first:
            next(iter(first))
            before = len(calls)
            with pytest.raises(openai.RateLimitError):
                c.completions.create(model="tiny", prompt=PROMPT)
            assert len(calls) == before  # refused without tokenizing the prompt


def test_a_chat_refusal_comes_before_the_template_and_the_tokenizer(tokenizer, monkeypatch):
    parts = endless_router(tokenizer, max_queued_requests=1)
    template = ChatTemplate(LLAMA3_CHAT_TEMPLATE, {"bos_token": "<|begin_of_text|>"})
    rendered = []
    real = template.render
    monkeypatch.setattr(template, "render", lambda *a, **k: rendered.append(1) or real(*a, **k))
    with serve(parts, chat_template=template) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        with c.chat.completions.create(model="tiny", messages=messages, stream=True) as first:
            next(iter(first))
            assert rendered == [1]
            with pytest.raises(openai.RateLimitError) as refused:
                c.chat.completions.create(model="tiny", messages=messages)
            assert rendered == [1]  # refused without rendering (or tokenizing) the messages
            assert "router.max_queued_requests=1" in refused.value.message
            assert refused.value.response.headers["Retry-After"] == "1"
