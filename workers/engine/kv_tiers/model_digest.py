"""A model's identity for the KV tiers: a digest of what it is, not of where it lives.

Two directories holding the same checkpoint (a copy on another node, a re-download) must
share their disk tier and their peers' blocks; two checkpoints at the same path one after
the other (a fine-tune written over its base) must not. So the digest covers
``config.json`` byte for byte and every weight file's name, size and content.

Reading every byte of a many-GiB checkpoint would add seconds to each start, so a weight
file contributes its first and last MiB (a safetensors file's first MiB holds its header:
every tensor's name, dtype, shape and offset) and 1 MiB at 14 evenly spaced offsets in
between: two checkpoints of the same architecture that differ in their weights differ
there unless they are equal in all those 16 MiB. Files under 16 MiB are read whole.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 20
_NUM_CHUNKS = 16
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_digest(model_dir: str | Path) -> str:
    """32 hex characters naming the checkpoint in ``model_dir``. Raises ValueError when
    the directory has no config.json."""
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"model: {root} has no config.json")
    h = hashlib.blake2b(digest_size=16)
    h.update(b"config.json\0")
    h.update(config.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= _CHUNK * _NUM_CHUNKS:
                h.update(f.read())
                continue
            step = (size - _CHUNK) // (_NUM_CHUNKS - 1)
            for i in range(_NUM_CHUNKS):
                f.seek(i * step)
                h.update(f.read(_CHUNK))
    return h.hexdigest()
