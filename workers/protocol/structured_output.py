"""Structured outputs: the constraint a request's output must satisfy, and its check.

A :class:`StructuredOutput` rides in ``SamplingParams.structured`` from the router to the
workers. It is one of

- ``json_schema``: ``spec`` is a JSON Schema (JSON text). ``strict`` (OpenAI's
  ``response_format.json_schema.strict``): every keyword must be enforced, and a schema
  with one the engine cannot enforce is refused; not strict, such keywords are ignored
  (the output still has the schema's shape wherever it is enforced).
- ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
- ``regex``: the whole output matches ``spec`` (Rust ``regex`` syntax: no look-around,
  no back-references).
- ``grammar``: ``spec`` is a context-free grammar, in llguidance's Lark dialect or in
  llama.cpp's GBNF (vLLM's ``guided_grammar`` takes EBNF/GBNF; both are recognised).
- ``choice``: the whole output is one of ``choices``.

The grammar engine is llguidance (docs/structured-outputs.md says why). The router calls
:func:`check_structured_output` before admission (no tokenizer, no model: the grammar
alone is compiled), so a request the engine could not compile gets its 400 with the part
of the schema that fails; each worker compiles it again, for its tokenizer
(``workers/engine/grammar.py``). ``grammar_text`` is the one translation both use.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import llguidance

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# Bounds on what a request may ask the engine to compile (the router checks them first).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# Whitespace a JSON output may put between its tokens: nothing, one space, or one line
# break with up to 32 spaces or tabs of indentation: compact, `{"a": 1}` and pretty-printed
# JSON (eight levels of 4-space indents) all pass. Any JSON whitespace, unbounded, lets a
# model that starts a run of blank lines or spaces be held in it until max_tokens (a known
# failure of constrained decoding with "any whitespace").
_JSON_WHITESPACE = r"(?:\r?\n[ \t]{0,32}|[ ]?)"
_GBNF_MARKER = "::="  # GBNF/EBNF rules are written `name ::= ...`, Lark ones `name: ...`


@dataclass(frozen=True)
class StructuredOutput:
    """The constraint on one request's output; validated when built (ValueError naming
    the field). Hashable: the engine caches compiled grammars by it."""

    kind: str
    """One of ``KINDS``."""
    spec: str = ""
    """json_schema: the schema as JSON text; regex: the pattern; grammar: Lark or GBNF
    text; empty for json_object and choice."""
    choices: tuple[str, ...] = ()
    """choice: the strings the output may be (at least one); empty otherwise."""
    strict: bool = True
    """json_schema: refuse a schema with keywords the engine cannot enforce; False:
    ignore them. Must stay True for the other kinds."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured.spec must be a string, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured.spec ({self.kind}) must be at most {MAX_SPEC_CHARS} characters, "
                f"got {len(self.spec)}"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(f"structured.strict must be a bool, got {self.strict!r}")
        object.__setattr__(self, "choices", _normalise_choices(self.choices))
        needs_spec = self.kind in ("json_schema", "regex", "grammar")
        if needs_spec and not self.spec:
            raise ValueError(f"structured.spec must not be empty for {self.kind}")
        if not needs_spec and self.spec:
            raise ValueError(
                f"structured.spec must be empty for {self.kind}, got {self.spec[:40]!r}"
            )
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(
                "structured.choices must hold at least one string for choice"
                if self.kind == "choice"
                else f"structured.choices must be empty for {self.kind}"
            )
        if not self.strict and self.kind != "json_schema":
            raise ValueError(
                f"structured.strict must be true for {self.kind} (false: json_schema only)"
            )
        if self.kind == "json_schema":
            _parse_schema(self.spec)

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any], strict: bool = True) -> StructuredOutput:
        """From a schema given as JSON text or as the decoded object."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, strict=strict)


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured`` (not yet checked: ``check_structured_output``
    and the engine's compiler do that)."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_schema":
        # The schema's own whitespace choice (llguidance's x-guidance options) wins over
        # ours; a default pattern would otherwise override its whitespace_flexible.
        options: dict[str, Any] = {"whitespace_pattern": _JSON_WHITESPACE}
        if _chooses_whitespace(spec):
            options = {}
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec, defaults=options, overrides={"lenient": not structured.strict}
        )
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults={"whitespace_pattern": _JSON_WHITESPACE}
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in structured.choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if _GBNF_MARKER in spec:
        return llguidance.grammar_from("gbnf", spec)  # ValueError if it does not convert
    return llguidance.LLMatcher.grammar_from_lark(spec)


@functools.lru_cache(maxsize=256)
def check_structured_output(structured: StructuredOutput) -> None:
    """Router side, before admission: raise ValueError if no worker could compile
    ``structured``, naming the part that fails (for a JSON schema, the JSON pointer of
    the innermost subschema that fails alone with the same error). Needs no tokenizer
    or model; a few milliseconds for a typical schema; results are cached (a failure is
    not, and raises again)."""
    error = grammar_error(structured)
    if error is None:
        return
    where = ""
    if structured.kind == "json_schema":
        pointer = _failing_part(json.loads(structured.spec), error, strict=structured.strict)
        where = f" at {pointer or '/'}"
    raise ValueError(f"structured output ({structured.kind}){where}: {error}")


def grammar_error(structured: StructuredOutput) -> str | None:
    """llguidance's first error for ``structured`` without a tokenizer; None if it compiles."""
    try:
        text = grammar_text(structured)
    except ValueError as exc:
        return str(exc).strip()
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return messages[0].strip() if is_error else None


def _failing_part(schema: Any, error: str, *, strict: bool) -> str:
    """The JSON pointer of the innermost subschema of ``schema`` that, compiled alone
    (with the root's definitions beside it, so its references resolve), fails with
    ``error``; "" if only the whole schema does."""
    if not isinstance(schema, dict):
        return ""
    definitions = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    path = ""
    node: Any = schema
    while True:
        for child_path, child in _children(node):
            if isinstance(child, dict):
                trial = StructuredOutput.json_schema({**child, **definitions}, strict=strict)
                if grammar_error(trial) == error:
                    path, node = path + child_path, child
                    break
        else:
            return path


def _children(node: dict[str, Any]) -> list[tuple[str, Any]]:
    """(pointer suffix, subschema) of a schema node's direct subschemas."""
    out: list[tuple[str, Any]] = []
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            out += [(f"/{key}/{_escape(k)}", v) for k, v in node[key].items()]
    for key in ("items", "additionalProperties", "not", "contains", "propertyNames"):
        if isinstance(node.get(key), dict):
            out.append((f"/{key}", node[key]))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            out += [(f"/{key}/{i}", v) for i, v in enumerate(node[key])]
    return out


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")  # RFC 6901


def _chooses_whitespace(spec: str) -> bool:
    schema = json.loads(spec)
    options = schema.get("x-guidance") if isinstance(schema, dict) else None
    return isinstance(options, dict) and (
        "whitespace_flexible" in options or "whitespace_pattern" in options
    )


def _parse_schema(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured.spec (json_schema) is not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(
            f"structured.spec (json_schema) must be a JSON object, got {type(schema).__name__}"
        )


def _normalise_choices(choices: Any) -> tuple[str, ...]:
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise ValueError(f"structured.choices must be a sequence of strings, got {choices!r}")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"structured.choices must hold at most {MAX_CHOICES}, got {len(choices)}")
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"structured.choices must hold non-empty strings, got {choice!r}")
        if len(choice) > MAX_CHOICE_CHARS:
            raise ValueError(
                f"structured.choices must hold strings of at most {MAX_CHOICE_CHARS} "
                f"characters, got one of {len(choice)}"
            )
    return tuple(choices)
