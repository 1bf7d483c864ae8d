"""The output's constraint from an HTTP body (docs/structured-outputs.md).

OpenAI's ``response_format`` (``json_schema``, strict or not, and ``json_object``), and
vLLM's extra fields: ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` and the newer ``structured_outputs`` object. At most one per request:
two constraints would have to agree, and clients that send two have a bug. The router
judges the constraint itself (``router/validation.py``: it must compile); here only the
body's shape becomes :class:`~router.requests.StructuredOptions`, with the name of the
field it came from, so that a refusal names that field.
"""

from __future__ import annotations

import json

from router.http.errors import bad_field
from router.http.schemas import ChatCompletionRequest, CompletionRequest
from router.requests import StructuredOptions

# The router's paths of a constraint's parts (router/validation.py's messages).
STRUCTURED_PATHS = (
    "structured",
    "structured.kind",
    "structured.spec",
    "structured.choices",
    "structured.strict",
)


def structured_options(
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[StructuredOptions | None, str]:
    """(the constraint or None, the body field it came from). Raises OpenAIError (400)
    when the body sets more than one."""
    found: list[tuple[StructuredOptions, str]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((StructuredOptions("json_object"), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_field("response_format", "type json_schema needs a json_schema object")
        schema = fmt.json_schema.schema_
        if schema is None:
            options = StructuredOptions("json_object")
        else:
            options = StructuredOptions(
                "json_schema", json.dumps(schema), strict=bool(fmt.json_schema.strict)
            )
        found.append((options, "response_format"))
    if body.guided_json is not None:
        found.append((_json(body.guided_json), "guided_json"))
    if body.guided_regex is not None:
        found.append((StructuredOptions("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append(
            (StructuredOptions("choice", choices=tuple(body.guided_choice)), "guided_choice")
        )
    if body.guided_grammar is not None:
        found.append((StructuredOptions("grammar", body.guided_grammar), "guided_grammar"))
    extra = body.structured_outputs
    if extra is not None:
        parts = [
            (extra.json_, lambda v: _json(v)),
            (extra.json_object or None, lambda _: StructuredOptions("json_object")),
            (extra.regex, lambda v: StructuredOptions("regex", v)),
            (extra.choice, lambda v: StructuredOptions("choice", choices=tuple(v))),
            (extra.grammar, lambda v: StructuredOptions("grammar", v)),
        ]
        given = [make(value) for value, make in parts if value is not None]
        if len(given) != 1:
            raise bad_field(
                "structured_outputs",
                f"set exactly one of json, json_object, regex, choice, grammar (got {len(given)})",
            )
        found.append((given[0], "structured_outputs"))
    if len(found) > 1:
        names = ", ".join(source for _, source in found)
        raise bad_field(found[1][1], f"one output constraint per request, got {names}")
    return found[0] if found else (None, "")


def _json(value: dict | str) -> StructuredOptions:
    """vLLM's guided_json: a schema, as an object or as JSON text (strict, as vLLM is)."""
    return StructuredOptions("json_schema", value if isinstance(value, str) else json.dumps(value))
