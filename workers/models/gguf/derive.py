"""The Hugging Face view of a GGUF file: derived once, under a lock, in the cache directory.

``derive_model_dir("x.gguf")`` returns ``<cache>/gguf/<key>/<stem>/`` holding
``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``
(with the file's chat template) and ``model.gguf``, a symbolic link to the file: the
weights are read from the file itself, never copied. ``<key>`` names the file's resolved
path, size and modification time, so an edited or replaced file is derived again; the
last directory is the file's stem, so the served name defaults to it. The directory is
written beside its final place and renamed into it, so a reader sees a whole one or
none; a ``filelock`` lock keeps concurrent first starts (several workers) from deriving
it twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from filelock import FileLock

GGUF_WEIGHTS = "model.gguf"
_DERIVER_VERSION = "2"  # bump when what is written changes: old views are derived again


def default_cache_dir() -> Path:
    """Where Baton keeps what it makes or fetches: ``$BATON_CACHE_DIR``, else
    ``~/.cache/baton``."""
    env = os.environ.get("BATON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "baton"


def is_gguf_file(path: str | Path) -> bool:
    """A file whose name ends in ``.gguf`` (checked for the format's magic when read)."""
    path = Path(path).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def derive_model_dir(gguf_path: str | Path, cache_dir: Path | None = None) -> Path:
    """The derived directory of ``gguf_path`` (made on first use); ValueError naming what
    in the file is not supported, or that it is not a GGUF file."""
    source = Path(gguf_path).expanduser().resolve()
    stat = source.stat()
    key = hashlib.blake2b(
        f"{_DERIVER_VERSION}\0{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode(),
        digest_size=8,
    ).hexdigest()
    root = (cache_dir or default_cache_dir()) / "gguf" / key
    model_dir = root / source.stem
    if (model_dir / GGUF_WEIGHTS).exists():
        return model_dir
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".lock")):
        if (model_dir / GGUF_WEIGHTS).exists():
            return model_dir
        staging = root / f".{source.stem}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            _write_view(source, staging)
            staging.rename(model_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def _write_view(source: Path, out: Path) -> None:
    from gguf import GGUFReader

    from workers.models.gguf.metadata import generation_config, hf_config, read_metadata
    from workers.models.gguf.tokenizer import build_tokenizer, tokenizer_config

    try:
        reader = GGUFReader(str(source))
    except ValueError as exc:  # the reader checks the magic and version
        raise ValueError(f"{source} is not a readable GGUF file: {exc}") from None
    meta = read_metadata(reader)
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    _write_json(out / "config.json", hf_config(meta, set(types), types))
    _write_json(out / "generation_config.json", generation_config(meta))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta))
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    (out / GGUF_WEIGHTS).symlink_to(source)  # last: its presence means the view is whole


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
