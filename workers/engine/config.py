"""Engine configuration: one frozen dataclass, validated once, "auto" resolved at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Hugging Face model directory (config.json, *.safetensors, tokenizer.json)."""
    dtype: str = "auto"
    """float32 | float16 | bfloat16 | auto (bfloat16 on CUDA, float32 on CPU)."""
    device: str = "auto"
    """cpu | cuda | cuda:N | auto (CUDA when available)."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens; None = the model's max_position_embeddings."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """KV-cache blocks; None = sized from kv_cache_memory_gib (CPU) or gpu_memory_fraction (CUDA)."""
    kv_cache_memory_gib: float = 2.0
    """KV-cache size on CPU when num_kv_blocks is None."""
    gpu_memory_fraction: float = 0.90
    """Share of the GPU's memory the engine may use (weights + KV cache) on CUDA."""
    max_num_seqs: int = 64
    """Most requests in one batch (running at once)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks of at most this."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes across requests."""
    seed: int = 0
    """Seed of the shared sampling generator (requests with their own seed use theirs)."""
    detokenize: bool = True
    """Detokenize and match stop strings here; False when the router does both at the edge."""

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request needs a token each step; a smaller budget would starve
            # the requests at the end of the running list.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(
                f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}"
            )
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device: {exc}") from None

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
