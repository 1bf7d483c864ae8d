"""A model's chat template, rendered as Hugging Face ``transformers`` renders it.

The template comes from the model directory: ``chat_template.jinja`` (newer checkpoints),
else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates:
the one named ``default``). Templates are code shipped with a checkpoint, so they run in
Jinja2's immutable sandbox (no attribute access to Python internals, no mutation of the
arguments), with the globals and filters HF gives them: ``raise_exception``,
``strftime_now``, ``tojson``, and the special tokens (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages (its ``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    # HF's: no HTML escaping (unlike Jinja's built-in tojson), non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = special_tokens or {}
        self._template = env.from_string(source)  # jinja2.TemplateSyntaxError if malformed

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The directory's template, or None when it has none. Raises ValueError for a
        template that does not compile (a broken checkpoint should fail at start-up)."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            source = jinja_path.read_text()
        if not isinstance(source, str) or not source:
            return None
        tokens = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):  # an AddedToken
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
        try:
            return cls(source, tokens)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{model_dir}: the chat template does not compile: {exc}") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of ``messages`` (role/content dicts), with ``tools`` (OpenAI's
        tool definitions) for a template that renders them. Raises ChatTemplateError."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            # Includes the sandbox's SecurityError: a template that tries to escape it.
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
