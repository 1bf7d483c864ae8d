"""Bounds on the work one call may ask (docs/security.md): each refused with a 400 /
INVALID_ARGUMENT naming the field, before admission, and the server keeps serving."""

from __future__ import annotations

import httpx2 as httpx
import pytest

from cluster.tools.families import LLAMA3_CHAT_TEMPLATE
from cluster.tools.make_model import build_tokenizer
from router.http.chat_template import ChatTemplate
from router.http.convert import MAX_CHOICES, MAX_MESSAGES
from router.requests import GenerateRequest, StoppingOptions
from router.validation import InvalidRequest, validate
from tests.router.http_harness import serve
from tests.router.test_typed_flow import make_router
from workers.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))


def test_stop_token_ids_are_capped():
    ok = GenerateRequest("hi", stopping=StoppingOptions(stop_token_ids=tuple(range(64))))
    assert len(validate(ok, "tiny", "r").params.stop_token_ids) == 64
    many = GenerateRequest("hi", stopping=StoppingOptions(stop_token_ids=tuple(range(65))))
    with pytest.raises(InvalidRequest, match=r"^stopping.stop_token_ids: at most 64 .* got 65"):
        validate(many, "tiny", "r")


def test_prompt_batches_and_messages_are_capped_over_http(tokenizer):
    template = ChatTemplate(LLAMA3_CHAT_TEMPLATE)
    with serve(make_router(tokenizer), chat_template=template) as s:
        batch = {
            "model": "tiny",
            "prompt": ["hi"] * (MAX_CHOICES // 2 + 1),
            "n": 2,
            "max_tokens": 1,
        }
        refused = httpx.post(s.url + "/v1/completions", json=batch, timeout=30)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "prompt" and f"at most {MAX_CHOICES} choices" in error["message"]
        messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
        body = {"model": "tiny", "messages": messages, "max_tokens": 1}
        refused = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "messages"
        assert f"at most {MAX_MESSAGES} messages" in refused.json()["error"]["message"]
        # Still serving, and at the bound it answers.
        batch["prompt"] = ["hi"] * (MAX_CHOICES // 2)
        batch["max_tokens"] = 2  # (the scripted prefill worker hands off even its last token)
        answered = httpx.post(s.url + "/v1/completions", json=batch, timeout=60)
        assert answered.status_code == 200, answered.text
        assert len(answered.json()["choices"]) == MAX_CHOICES
