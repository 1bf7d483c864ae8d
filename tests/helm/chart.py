"""What the chart tests share: the chart's paths, helm's merge of values, the helm CLI."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "baton"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
HELM = shutil.which("helm")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def merge_values(base: dict, override: dict) -> dict:
    """Helm's merge of user values over the chart's: maps merge key by key, anything else
    replaces, and null deletes the key."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def helm(*args: str) -> subprocess.CompletedProcess:
    assert HELM is not None
    return subprocess.run(
        [HELM, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def render(*args: str) -> dict[tuple[str, str], dict]:
    """``helm template`` with these arguments: the objects by (kind, name)."""
    proc = helm("template", "baton", str(CHART), *args)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}
