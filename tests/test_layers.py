"""The layers of the code base and the one-way imports between them (docs/architecture.md).

Every import of a project package, lazy ones inside functions included, is checked
against `MAY_IMPORT`: a folder says what its files may import. A new folder must be
added here (and to docs/architecture.md) before it can be imported from anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("cluster", "router", "workers", "kvtransfer", "kernels", "proto")

# Layer -> the other layers its modules may import. Top to bottom:
# cluster -> router -> workers -> kvtransfer -> kernels; inside workers,
# serving -> parallel -> engine -> models -> (protocol, text).
_WORKERS_BELOW_ENGINE = {
    "workers.models",
    "workers.protocol",
    "workers.text",
    "kvtransfer",
    "kernels",
}
MAY_IMPORT: dict[str, set[str]] = {
    "proto": set(),
    "kernels": set(),
    "kvtransfer": {"kernels"},
    "workers.protocol": set(),
    "workers.text": set(),
    "workers.models": {"kvtransfer", "kernels"},
    "workers.engine": _WORKERS_BELOW_ENGINE,
    "workers.parallel": _WORKERS_BELOW_ENGINE | {"workers.engine"},
    "workers.serving": _WORKERS_BELOW_ENGINE | {"workers.engine", "workers.parallel"},
    # `workers/__init__.py` re-exports the public names of its sub-packages, lazily.
    "workers": {"workers.engine", "workers.protocol"},
    # The router process loads neither torch nor the engine: only what the workers
    # and the router agree on (protocol), the tokenizer, and the gRPC types.
    "router": {"proto", "workers.protocol", "workers.text"},
    "cluster.tools": set(),
    "cluster.planner": set(),
    "cluster.loadgen": {"cluster", "proto"},
    "cluster": {
        "cluster.loadgen",
        "cluster.tools",
        "cluster.planner",
        "router",
        "proto",
        "workers",
        "workers.protocol",
        "workers.text",
        "workers.models",
        "workers.engine",
        "workers.serving",
        "kvtransfer",
    },
}
# Layers that must not import torch themselves (the router's side of the wire).
TORCH_FREE = {"workers.protocol", "workers.text", "router", "proto"}


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to: a top-level package, or one of the
    sub-packages of `workers` and `cluster` (each is a layer of its own)."""
    parts = module.split(".")
    if (
        parts[0] in ("workers", "cluster")
        and len(parts) > 1
        and (ROOT / parts[0] / parts[1]).is_dir()
    ):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in a file, lazy ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from workers import engine` names a sub-package: count it as such.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _source_files() -> list[Path]:
    files = [p for pkg in PROJECT for p in (ROOT / pkg).rglob("*.py")]
    return sorted(p for p in files if "_pb2" not in p.name)


def test_every_layer_is_declared() -> None:
    layers = {
        layer_of(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in _source_files()
    }
    assert layers <= set(MAY_IMPORT), f"layers missing from MAY_IMPORT: {layers - set(MAY_IMPORT)}"


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_one_way(path: Path) -> None:
    own = layer_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
    wrong = []
    for line, module in imports_of(path):
        top = module.split(".")[0]
        if top == "torch" and own in TORCH_FREE:
            wrong.append(f"{path.name}:{line} imports torch")
        if top not in PROJECT:
            continue
        target = layer_of(module)
        if target != own and target not in MAY_IMPORT[own]:
            wrong.append(f"{path.name}:{line} imports {module} ({target})")
    assert not wrong, f"{own} may import only {sorted(MAY_IMPORT[own])}: {wrong}"


def test_the_checker_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function and a `from` import both count."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    import router.server\n\nfrom workers import serving\n")
    assert sorted(imports_of(sample)) == [(2, "router.server"), (4, "workers.serving")]
    assert layer_of("workers.serving.service") == "workers.serving"
    assert layer_of("workers.serving") == "workers.serving"
    assert layer_of("router.policy") == "router"
