"""Typed config from plain data: frozen dataclasses in, errors that name the key path out.

A config section is a frozen dataclass whose fields carry their doc and constraints in
``field(metadata=...)`` (built with :func:`option`). :func:`load_section` turns a mapping
parsed from YAML into that dataclass, rejecting unknown keys and bad values with messages
like ``prefill.tensor_parallel: must be >= 1, got 0``. :func:`json_schema` renders the same
definitions as JSON Schema, so the Helm chart validates against one source of truth.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is wrong; the message starts with its key path."""


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
    meta = {"doc": doc, "ge": ge, "le": le, "gt": gt, "lt": lt}
    if isinstance(default, (list, dict)):
        raise TypeError("use immutable defaults (tuples) in config sections")
    return dataclasses.field(default=default, metadata=meta)


def section(default_factory: type, doc: str) -> Any:
    """A nested config section."""
    return dataclasses.field(default_factory=default_factory, metadata={"doc": doc})


def load_section(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data`` (a mapping or None), validating every key."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key (known: {', '.join(sorted(fields))})")
    values = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key = f"{path}.{name}" if path else name
        values[name] = _convert(hints[name], data[name], key, f.metadata)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as exc:  # cross-field checks in __post_init__
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def _convert(tp: Any, value: Any, key: str, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return load_section(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, key, meta)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{key}: must be one of {', '.join(map(str, choices))}; got {value!r}"
            )
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_kind(value)}")
        return _check_bounds(value, key, meta)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {_kind(value)}")
        return _check_bounds(float(value), key, meta)
    if tp is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: expected a non-empty string, got {_kind(value)}")
        return value
    raise TypeError(f"{key}: unsupported config type {tp!r}")


def _check_bounds(value: float, key: str, meta: Mapping[str, Any]) -> Any:
    checks = (
        ("ge", lambda b: value >= b, ">="),
        ("gt", lambda b: value > b, ">"),
        ("le", lambda b: value <= b, "<="),
        ("lt", lambda b: value < b, "<"),
    )
    for name, ok, sign in checks:
        bound = meta.get(name)
        if bound is not None and not ok(bound):
            raise ConfigError(f"{key}: must be {sign} {bound}, got {value}")
    return value


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, Mapping) else "a mapping"


def json_schema(cls: type) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a config section, with docs and defaults."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        prop = _type_schema(hints[f.name])
        prop["description"] = f.metadata.get("doc", "")
        if f.default is not dataclasses.MISSING:
            prop["default"] = f.default
        for name, keyword in (
            ("ge", "minimum"),
            ("le", "maximum"),
            ("gt", "exclusiveMinimum"),
            ("lt", "exclusiveMaximum"),
        ):
            if f.metadata.get(name) is not None:
                prop[keyword] = f.metadata[name]
        props[f.name] = prop
    return {"type": "object", "additionalProperties": False, "properties": props}


def _type_schema(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return json_schema(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _type_schema(args[0])
        inner["type"] = [inner["type"], "null"] if "type" in inner else inner.get("type")
        if "enum" in inner:
            inner["enum"] = [*inner["enum"], None]
        return inner
    if origin is Literal:
        return {"type": "string", "enum": list(typing.get_args(tp))}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return {"type": simple[tp]}
