"""``hf://org/name[@revision]``: a model on the Hugging Face Hub, downloaded once.

``resolve_hub_path("hf://HuggingFaceTB/SmolLM2-135M-Instruct")`` downloads what Baton
reads of a model repository (config, safetensors weights and their index, tokenizer
files, generation config; no other formats, no README or images) with
``huggingface_hub.snapshot_download`` into its own cache under Baton's
(``<cache>/hub``), and returns the snapshot directory; a second call finds it there. A
private or gated repository reads ``HF_TOKEN`` as ``huggingface_hub`` does. A failure (no
network, no such repository, no access) is a ValueError naming the repository and what
to do, never a traceback from the HTTP layer.
"""

from __future__ import annotations

from pathlib import Path

PREFIX = "hf://"
# What Baton reads of a model repository.
_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]


def is_hub_path(path: str) -> bool:
    return path.startswith(PREFIX)


def resolve_hub_path(path: str, cache_dir: Path) -> Path:
    """The local snapshot of ``hf://org/name[@revision]``, downloaded on first use."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = path.removeprefix(PREFIX).partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ValueError(f"{path}: expected hf://org/name or hf://org/name@revision")
    try:
        local = snapshot_download(
            repo, revision=revision or None, cache_dir=cache_dir / "hub",
            allow_patterns=_PATTERNS,
        )  # fmt: skip
    except LocalEntryNotFoundError:
        raise ValueError(
            f"{path}: cannot reach the Hugging Face Hub and the model is not in "
            f"{cache_dir / 'hub'} (no network? download it where there is one, or set "
            f"model.path to a local directory)"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"{path}: download from the Hugging Face Hub failed: {exc}") from None
    model_dir = Path(local)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{path}: the repository has no config.json (not a model Baton loads)")
    return model_dir
