"""Render docs/config.md from the config definitions (one source of truth: the sections in
cluster/config.py, whose engine settings come from workers/engine/config.py).

    python -m cluster.config_docs > docs/config.md

tests/cluster/test_config.py fails when docs/config.md is stale.
"""

from __future__ import annotations

import typing

from cluster.config import EMBEDDED_DEFAULT, ClusterConfig
from cluster.config_schema import ConfigSection, bounds, subsection

HEADER = """# Cluster config reference

Generated from the pydantic models of `cluster/config.py` and `cluster/config_router.py` (the engine settings' defaults, docs and bounds from
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


def _rows(prefix: str, cls: type[ConfigSection]) -> list[str]:
    """One table row per key of section ``cls``; a nested section's keys follow its own
    (``decode.speculative.method``)."""
    rows = []
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    for name, f in cls.model_fields.items():
        key = f"{prefix}.{name}"
        if (nested := subsection(f)) is not None:
            rows += _rows(key, nested)
            continue
        kind = _type_name(f.annotation)
        limits = ", ".join(f"{signs[k]} {v}" for k, v in bounds(f).items())
        if limits:
            kind += f" ({limits})"
        default = "unset" if f.default is None else f"`{f.default}`"
        rows.append(f"| `{key}` | {kind} | {default} | {f.description} |")
    return rows


def _embedded_default_line() -> str:
    """Where the embedded default (no CONFIG) differs from the defaults below."""
    changed = []
    for top in ClusterConfig.model_fields:
        ours, plain = getattr(EMBEDDED_DEFAULT, top), getattr(ClusterConfig(), top)
        for name in type(ours).model_fields:
            if getattr(ours, name) != getattr(plain, name):
                changed.append(f"`{top}.{name}: {getattr(ours, name)}`")
    return (
        "The embedded default (`baton serve` with no CONFIG) is every default below, "
        f"except {', '.join(changed)} (why: `EMBEDDED_DEFAULT` in `cluster/config.py`).\n"
    )


def render() -> str:
    lines = [HEADER, _embedded_default_line()]
    for name, top in ClusterConfig.model_fields.items():
        section = subsection(top)
        assert section is not None, name
        lines += [f"## `{name}` — {top.description}", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += _rows(name, section)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
