"""Every module of the installed packages imports with the declared dependencies.

With the project installed as a library would be (``pip install .`` in a fresh
environment, no constraints file: docs/dependencies.md), a module that imports a package
pyproject.toml does not declare, or a version outside the declared range lacks, fails here
with the module's name rather than in a user's first request. The walk covers the
packages pyproject.toml ships (setuptools ``packages.find``).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
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
