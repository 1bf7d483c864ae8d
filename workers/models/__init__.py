"""Model definitions and weight loading for the worker runtime.

May import: `kernels`, `kvtransfer` (the KV layout) and torch. Public names are imported on
first use, so the serving driver can read a model's architecture (`arch_config`) and its
rank layout (`rank_layout`) without loading torch.
"""

from importlib import import_module

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "workers.models.arch_config",
    "ArchConfig": "workers.models.arch_config",
    "CausalLM": "workers.models.base",
    "load_model": "workers.models.loader",
    "ParallelContext": "workers.models.parallel",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'workers.models' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
