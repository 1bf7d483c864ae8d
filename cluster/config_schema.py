"""Config sections as pydantic models, and their errors in the YAML's key paths.

A config section is a :class:`ConfigSection`: a frozen, strict pydantic model whose fields
carry their doc and bounds (built with :func:`option`, :func:`section` or
:func:`declared_option`). :func:`load_section` validates a mapping parsed from YAML and
turns pydantic's ``ValidationError`` into one :class:`ConfigError` worded the way the
operator reads the YAML (``prefill.tensor_parallel: must be >= 1, got 0``): the messages
are the project's contract (tests, the Helm chart's docs), not pydantic's, which change
between its releases. :func:`json_schema` renders the same models as self-contained JSON
Schema, so the Helm chart validates against one source of truth.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

S = TypeVar("S", bound="ConfigSection")
# pydantic keeps Field(ge=...) as annotated_types.Ge(ge=...) in FieldInfo.metadata.
_BOUNDS = {
    annotated_types.Ge: "ge",
    annotated_types.Gt: "gt",
    annotated_types.Le: "le",
    annotated_types.Lt: "lt",
}
_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
# A key no field has; "invalid_key": one that is not even a string (strict mode).
_UNKNOWN_KEY = ("extra_forbidden", "invalid_key")


class ConfigError(ValueError):
    """A config value is wrong; the message starts with its key path."""


class ConfigSection(BaseModel):
    """Base of every section. Strict: YAML's ``"1"`` is not an int nor ``true`` an int (an
    int is a float); ``""`` is no string (an unset value is ``null``); unknown keys are
    refused rather than silently ignored (a typo would otherwise fall back to a default)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, str_min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_defaults(cls, data: Any) -> Any:
        # `prefill:` with nothing under it parses as None: the section at its defaults.
        if data is None:
            return {}
        return dict(data) if isinstance(data, Mapping) else data


@dataclasses.dataclass(frozen=True)
class Declared:
    """Field metadata: the field sets setting ``name`` of the declaration ``kind``
    (``"engine"``: ``EngineConfig``, ``"transfer"``: ``KVTransferConfig``); pydantic
    ignores it, :func:`declared_name` finds it."""

    kind: str
    name: str


def option(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
) -> Any:
    """A config field: its default, a one-line doc and numeric bounds."""
    if isinstance(default, (list, dict)):
        raise TypeError("use immutable defaults (tuples) in config sections")
    return Field(default=default, description=doc, ge=ge, le=le, gt=gt, lt=lt)


def section(default_factory: type, doc: str) -> Any:
    """A nested config section."""
    return Field(default_factory=default_factory, description=doc)


def declared_option(declared: dataclasses.Field, kind: str, name: str) -> Any:
    """A config field from a dataclass field declared elsewhere (its ``metadata`` has the
    keys doc, ge, le, gt, lt): the same default, doc and bounds, tagged with what it sets."""
    meta = declared.metadata
    bounds = {k: meta.get(k) for k in _SIGNS}
    field = option(declared.default, meta["doc"], **bounds)
    field.metadata.append(Declared(kind, name))
    return field


def declared_name(field: FieldInfo, kind: str) -> str | None:
    """The ``kind`` setting (see :class:`Declared`) that ``field`` sets, if any."""
    tags = [m.name for m in field.metadata if isinstance(m, Declared) and m.kind == kind]
    return tags[0] if tags else None


def bounds(field: FieldInfo) -> dict[str, float]:
    """A field's numeric bounds as ``{"ge": 1, "le": 1024}`` (in ge, gt, le, lt order)."""
    found = {
        _BOUNDS[type(m)]: getattr(m, _BOUNDS[type(m)]) for m in field.metadata if type(m) in _BOUNDS
    }
    return {k: found[k] for k in _SIGNS if k in found}


def subsection(field: FieldInfo) -> type[ConfigSection] | None:
    """The section class of a nested-section field, else None."""
    tp = field.annotation
    return tp if isinstance(tp, type) and issubclass(tp, ConfigSection) else None


def load_section(cls: type[S], data: Any, path: str = "") -> S:
    """Build section ``cls`` from ``data`` (a mapping or None), validating every key."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise config_error(cls, exc, path) from None


def replaced(sec: S, **changes: Any) -> S:
    """``sec`` with ``changes``, validated again: pydantic's ``model_copy(update=...)``
    would skip the checks. Unchanged nested sections are kept as they are (valid already)."""
    return load_section(type(sec), {**dict(sec), **changes})


def config_error(cls: type[ConfigSection], exc: ValidationError, path: str = "") -> ConfigError:
    """The error an operator sees, of those pydantic found: the first one reading the file
    top-down (a section's unknown keys before its values, values in declaration order,
    cross-field checks last), the order the messages have always come in."""
    error = min(exc.errors(), key=lambda e: _order(cls, e))
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in (path, *loc) if p != "")
    owner = _section_at(cls, loc[:-1]) if loc else cls
    kind, value = error["type"], error["input"]
    if kind in ("value_error", "assertion_error"):  # a model_validator's cross-field check
        return ConfigError(f"{key or 'config'}: {error['ctx']['error']}")
    if kind in _UNKNOWN_KEY:
        return ConfigError(f"{key}: unknown key (known: {', '.join(sorted(owner.model_fields))})")
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return ConfigError(f"{key or 'config'}: expected a mapping, got {_kind(value)}")
    field = owner.model_fields.get(str(loc[-1])) if loc else None
    if field is None:
        return ConfigError(f"{key or 'config'}: {error['msg']}")
    tp = _unwrap(field.annotation)
    if kind == "literal_error":
        choices = ", ".join(map(str, typing.get_args(tp)))
        return ConfigError(f"{key}: must be one of {choices}; got {value!r}")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        name = next(iter(error["ctx"]))
        shown = float(value) if tp is float else value
        return ConfigError(f"{key}: must be {_SIGNS[name]} {error['ctx'][name]}, got {shown}")
    expected = {
        "bool_type": "true or false",
        "int_type": "an integer",
        "float_type": "a number",
        "string_type": "a non-empty string",
        "string_too_short": "a non-empty string",
    }
    if kind in expected:
        return ConfigError(f"{key}: expected {expected[kind]}, got {_kind(value)}")
    return ConfigError(f"{key or 'config'}: {error['msg']}")


def _order(cls: type[ConfigSection], error: Any) -> tuple:
    """Sort key of a pydantic error: per level of its key path, an unknown key (by name)
    before a field (by declaration order), a section's own cross-field check after both."""
    key: list[tuple] = []
    owner: type[ConfigSection] | None = cls
    loc = tuple(error["loc"])
    for depth, part in enumerate(loc):
        names = list(owner.model_fields) if owner else []
        last = depth == len(loc) - 1
        if last and error["type"] in _UNKNOWN_KEY:
            key.append((0, str(part)))
        else:
            key.append((1, names.index(part) if part in names else len(names)))
        owner = subsection(owner.model_fields[part]) if owner and part in names else None
    return (*key, (2,))


def _section_at(cls: type[ConfigSection], loc: tuple) -> type[ConfigSection]:
    """The section at key path ``loc`` below ``cls``."""
    for part in loc:
        nested = subsection(cls.model_fields[str(part)])
        assert nested is not None, loc
        cls = nested
    return cls


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, Mapping) else "a mapping"


# JSON Schema keywords in the order the generated files list them; others follow.
_KEY_ORDER = (
    "type",
    "enum",
    "additionalProperties",
    "properties",
    "description",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
)


def json_schema(cls: type[ConfigSection]) -> dict[str, Any]:
    """JSON Schema of a config section, with docs and defaults, self-contained: pydantic's
    ``$defs`` inlined (the Helm chart embeds it under ``properties.config``, where
    root-relative ``$ref``s would point nowhere), ``X | None`` as ``"type": [X, "null"]``
    and no ``title``s (pydantic derives them from the key: noise next to the docs)."""
    schema = cls.model_json_schema()
    defs = schema.pop("$defs", {})
    return _clean(schema, defs)


def _clean(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = {k: v for k, v in node.items() if k != "title"}
    if "$ref" in node:
        target = _clean(defs[node.pop("$ref").rsplit("/", 1)[-1]], defs)
        node = {**target, **node}
    if "anyOf" in node:
        branches = node.pop("anyOf")
        inner = next(_clean(b, defs) for b in branches if b != {"type": "null"})
        inner["type"] = [inner["type"], "null"]
        if "enum" in inner:
            inner["enum"] = [*inner["enum"], None]
        node = {**inner, **node}
    if "properties" in node:
        node["properties"] = {k: _clean(v, defs) for k, v in node["properties"].items()}
    ordered = {k: node[k] for k in _KEY_ORDER if k in node}
    return {**ordered, **{k: v for k, v in sorted(node.items()) if k not in ordered}}
