"""Chat templates (router/http/chat_template.py) render as Hugging Face renders them, in
a sandbox, from wherever a model directory keeps them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from cluster.tools.make_model import make_model
from router.http.chat_template import ChatTemplate, ChatTemplateError

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is a KV cache?  "},
    {"role": "assistant", "content": "Saved keys and values."},
    {"role": "user", "content": "Ünïcödé ✓"},
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("chat") / request.param, request.param, "tiny")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(model_dir, add_generation_prompt):
    template = ChatTemplate.from_dir(model_dir)
    assert template is not None
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    expected = hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(MESSAGES, add_generation_prompt) == expected


def test_no_template_is_none_and_a_jinja_file_wins(tmp_path):
    model_dir = make_model(tmp_path / "mistral", "mistral", "tiny")
    assert ChatTemplate.from_dir(model_dir) is None
    (model_dir / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert ChatTemplate.from_dir(model_dir).render(MESSAGES) == "<s>You are terse."


def test_named_templates_take_the_default(tmp_path):
    config = {
        "bos_token": "<s>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ messages | length }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_dir(tmp_path).render(MESSAGES) == "4"


def test_a_template_that_does_not_compile_fails_at_load(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.from_dir(tmp_path)


def test_raise_exception_refuses_the_messages():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}ok"
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        template.render(MESSAGES)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",  # immutable: the arguments stay as given
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_the_sandbox_refuses_escapes(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_tojson_keeps_unicode_unescaped():
    template = ChatTemplate("{{ messages[0] | tojson }}")
    assert template.render([{"role": "user", "content": "é<b>"}]) == (
        '{"role": "user", "content": "é<b>"}'
    )
