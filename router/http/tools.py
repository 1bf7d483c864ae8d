"""Tool calling on ``/v1/chat/completions`` (docs/structured-outputs.md, "Tool calls").

The tools go to the model's chat template (its ``tools`` variable, as Hugging Face passes
them), and the output becomes OpenAI's ``tool_calls``:

- ``tool_choice`` a named function: the output is constrained to that function's
  ``parameters`` schema, and is its arguments (compact JSON, as for ``required``).
- ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}``
  objects, one schema per tool (at most one element with ``parallel_tool_calls: false``).
- ``auto`` (OpenAI's default when tools are given): the model decides, unconstrained, and
  its calls are parsed from the text in the template's own format: Hermes/Qwen's
  ``<tool_call>{json}</tool_call>`` blocks when the template writes them, else a bare JSON
  object ``{"name", "arguments" | "parameters"}`` (Llama 3's). Streamed, the text before a
  call goes out as it comes (``AutoStream``); the calls come whole at the end. A template that does not
  render ``tools`` cannot tell the model about them: ``auto`` is refused there (as vLLM
  refuses it without a parser), naming the choices that work with any model.
- ``none``: the tools are not rendered, the output is text.

Grammar-constrained choices work with any model, since the grammar makes the call; with
``auto`` a model that was not trained for tools will rarely call one.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from router.http.chat_template import ChatTemplate
from router.http.errors import bad_field
from router.http.schemas import ChatCompletionRequest
from router.requests import StructuredOptions

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_OPEN = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}

Parser = Literal["hermes", "json"]


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolCalling:
    """How one request's output becomes tool calls."""

    mode: Literal["named", "required", "auto"]
    names: tuple[str, ...]  # the tools' names (named: the one chosen)
    parser: Parser = "json"  # auto: the template's format

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output. A constrained output that does not parse
        (cut by max_tokens) is returned as content with no calls."""
        if self.mode == "named":
            return None, [_call(self.names[0], text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            calls = [_from_object(item, self.names) for item in items]
            return None, [c for c in calls if c is not None]
        if self.parser == "hermes":
            calls = [_from_text(block, self.names) for block in _HERMES.findall(text)]
            found = [c for c in calls if c is not None]
            content = _HERMES.sub("", text).strip() if found else text
            return content or None, found
        call = _from_text(text.strip(), self.names)
        return (text, []) if call is None else (None, [call])


class AutoStream:
    """One streamed choice under ``tool_choice: auto``: its text goes out as content up to
    where a call may begin (Hermes: a ``<tool_call>`` tag, or the part of one the text ends
    with; JSON: an output that starts with ``{``), and what follows is held and read as
    calls at the end. A reply without calls streams as any reply does."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.text = ""
        self.sent = 0  # characters of text already out as content
        self.holding = False
        self.is_plain = False  # json: the output did not start with "{": no call can come

    def feed(self, piece: str) -> str:
        """Append ``piece``; returns the content that may go out now."""
        self.text += piece
        if self.holding:
            return ""
        rest = self.text[self.sent :]
        if self.calling.parser == "hermes":
            at = rest.find(_OPEN)
            if at >= 0:
                self.holding, out = True, rest[:at]
            else:  # keep back an ending that may be the start of the tag
                keep = next(
                    (n for n in range(len(_OPEN) - 1, 0, -1) if rest.endswith(_OPEN[:n])), 0
                )
                out = rest[: len(rest) - keep]
        elif self.is_plain:
            out = rest
        else:
            stripped = self.text.lstrip()
            if not stripped:
                return ""  # only whitespace so far: it cannot tell yet
            self.holding = stripped[0] == "{"
            self.is_plain = not self.holding
            out = "" if self.holding else rest
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(the content not sent yet, the calls) at the output's end."""
        rest = self.text[self.sent :]
        if not self.holding:
            return rest, []
        content, calls = self.calling.parse(rest)
        return content or "", calls


def tool_calling(
    body: ChatCompletionRequest, template: ChatTemplate | None
) -> tuple[ToolCalling | None, StructuredOptions | None, list[dict[str, Any]] | None]:
    """(how to read the output as calls, the constraint that forces them, the tools for the
    template) of a chat request; all None without tools or with ``tool_choice: none``.
    Raises OpenAIError (400 naming the field)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_field("tool_choice", "needs tools")
        return None, None, None
    if len(body.tools) > MAX_TOOLS:
        raise bad_field("tools", f"at most {MAX_TOOLS} tools, got {len(body.tools)}")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        if not _NAME.match(name):
            raise bad_field(
                f"tools[{i}].function.name", f"1-64 letters, digits, _ or -, got {name[:80]!r}"
            )
        if name in schemas:
            raise bad_field(f"tools[{i}].function.name", f"{name!r} is defined twice")
        schemas[name] = tool.function.parameters or _ANY_OBJECT
    rendered = [tool.model_dump(exclude_none=True) for tool in body.tools]
    names = tuple(schemas)
    if choice == "none":
        return None, None, None
    if choice is not None and not isinstance(choice, str):
        name = choice.function.name
        if name not in schemas:
            raise bad_field("tool_choice", f"no tool named {name[:80]!r} (tools: {list(names)})")
        constraint = StructuredOptions("json_schema", json.dumps(_compact(schemas[name])))
        return ToolCalling("named", (name,)), constraint, rendered
    if choice == "required":
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": schemas[n]},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for n in names
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if body.parallel_tool_calls is False:
            array["maxItems"] = 1
        constraint = StructuredOptions("json_schema", json.dumps(_compact(array)))
        return ToolCalling("required", names), constraint, rendered
    if template is None or "tools" not in template.source:
        raise bad_field(
            "tool_choice",
            "this model's chat template does not render tools, so it cannot choose one "
            "('auto'); use 'required' or name a function (the output is then constrained "
            "to a call)",
        )
    parser: Parser = "hermes" if "<tool_call>" in template.source else "json"
    return ToolCalling("auto", names, parser), None, rendered


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls as templates read them: ``arguments`` decoded
    to an object (templates write it with ``tojson``), as transformers and vLLM do."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict(call.get("function", {}))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            # Text that is not JSON is kept as text: the template shows what was sent.
            with contextlib.suppress(json.JSONDecodeError):
                function["arguments"] = json.loads(arguments)
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """A forced call is written as compact JSON (llguidance's option; unless the schema
    chooses): arguments are read by programs, and no whitespace is all the length a model
    cannot run away with."""
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def new_call_id() -> str:
    """A call's id, in OpenAI's shape (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> ParsedCall:
    return ParsedCall(new_call_id(), name, arguments)


def _from_object(item: Any, names: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters"))
    if not isinstance(arguments, dict):
        return None
    return _call(item["name"], json.dumps(arguments, ensure_ascii=False))


def _from_text(text: str, names: tuple[str, ...]) -> ParsedCall | None:
    try:
        return _from_object(json.loads(text), names)
    except json.JSONDecodeError:
        return None
