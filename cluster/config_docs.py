"""Render docs/config.md from the config definitions (one source of truth: the sections in
cluster/config.py, whose engine settings come from workers/engine/config.py).

    python -m cluster.config_docs > docs/config.md

tests/cluster/test_config.py fails when docs/config.md is stale.
"""

from __future__ import annotations

import dataclasses
import typing

from cluster.config import EMBEDDED_DEFAULT, ClusterConfig

HEADER = """# Cluster config reference

Generated from `cluster/config.py` (the engine settings' defaults, docs and bounds from
`workers/engine/config.py`, the KV hand-off's from `kvtransfer/backend.py`) by `python -m cluster.config_docs > docs/config.md`; a test
fails when this file is stale. Every key is optional. Unknown keys and bad values are
refused at load time with the key path in the message. Example: `configs/example.yaml`.
"""


def _type_name(tp: typing.Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:  # Optional[X]
        return f"{_type_name(args[0])} or unset"
    return tp.__name__


def _bounds(meta: typing.Mapping[str, typing.Any]) -> str:
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return ", ".join(f"{signs[k]} {meta[k]}" for k in signs if meta.get(k) is not None)


def _rows(prefix: str, cls: type) -> list[str]:
    """One table row per key of section ``cls``; a nested section's keys follow its own
    (``decode.speculative.method``)."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += _rows(key, hints[f.name])
            continue
        kind = _type_name(hints[f.name])
        bounds = _bounds(f.metadata)
        if bounds:
            kind += f" ({bounds})"
        default = "unset" if f.default is None else f"`{f.default}`"
        rows.append(f"| `{key}` | {kind} | {default} | {f.metadata['doc']} |")
    return rows


def _embedded_default_line() -> str:
    """Where the embedded default (no CONFIG) differs from the defaults below."""
    changed = []
    for top in dataclasses.fields(ClusterConfig):
        ours, plain = getattr(EMBEDDED_DEFAULT, top.name), getattr(ClusterConfig(), top.name)
        for f in dataclasses.fields(ours):
            if getattr(ours, f.name) != getattr(plain, f.name):
                changed.append(f"`{top.name}.{f.name}: {getattr(ours, f.name)}`")
    return (
        "The embedded default (`baton serve` with no CONFIG) is every default below, "
        f"except {', '.join(changed)} (why: `EMBEDDED_DEFAULT` in `cluster/config.py`).\n"
    )


def render() -> str:
    lines = [HEADER, _embedded_default_line()]
    hints = typing.get_type_hints(ClusterConfig)
    for top in dataclasses.fields(ClusterConfig):
        lines += [f"## `{top.name}` — {top.metadata['doc']}", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += _rows(top.name, hints[top.name])
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
