"""Every module of the installed packages imports with the declared dependencies.

With the project installed as a library would be (``pip install .`` in a fresh
environment, no constraints file: docs/dependencies.md), a module that imports a package
pyproject.toml does not declare, or a version outside the declared range lacks, fails here
with the module's name rather than in a user's first request. The walk covers the
packages pyproject.toml ships (setuptools ``packages.find``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "workers", "router", "kvtransfer", "kernels", "proto")


def shipped_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(module.__path__, prefix=f"{package}."):
            if not info.name.endswith(".__main__"):  # runs the command line when imported
                names.append(info.name)
    return sorted(names)


def test_the_walk_covers_what_pyproject_ships() -> None:
    # (tomllib is 3.11+; the project supports 3.10.)
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*?)\]", text)
    assert found, "pyproject.toml lost [tool.setuptools.packages.find] include"
    include = re.findall(r'"([^"]+)"', found.group(1))
    assert sorted(p.rstrip("*") for p in include) == sorted(PACKAGES)
    # Sub-packages are walked too, not only top-level modules.
    assert "workers.engine.kv_tiers.dir_lock" in shipped_modules()


# Packages of an optional extra (pyproject.toml), by import name: a module may need one only
# when it belongs to that extra's feature (the Triton kernels run only on CUDA, and torch's
# CUDA wheels bring triton; the charts of `baton bench --plot`).
OPTIONAL = {"triton": ("cuda", "kernels.triton_"), "matplotlib": ("plot", "cluster.loadgen.plots")}


@pytest.mark.parametrize("name", shipped_modules())
def test_module_imports(name: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        extra, owner = OPTIONAL.get(missing, ("", ""))
        if extra and name.startswith(owner):
            pytest.skip(f"{name} belongs to the '{extra}' extra, not installed ({missing})")
        raise


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_level_names() -> dict[str, str]:
    """Third-party top-level import names of the shipped packages (lazy imports included),
    each with one file that imports it."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared() -> None:
    """Each third-party package a shipped module imports is a requirement of the installed
    project (its dependencies or one of its extras), not something that happens to arrive
    through another package."""
    declared = {
        _normalized(re.match(r"[A-Za-z0-9_.-]+", req).group(0))  # type: ignore[union-attr]
        for req in importlib.metadata.requires("baton") or ()
    }
    dists = importlib.metadata.packages_distributions()
    undeclared = []
    for top, where in sorted(imported_top_level_names().items()):
        # A namespace package (google.*) maps to several distributions: one must be ours.
        candidates = {_normalized(d) for d in dists.get(top, ())}
        if not candidates & declared:
            undeclared.append(f"{top} ({where}; distributions: {sorted(candidates) or '?'})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
