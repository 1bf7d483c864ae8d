"""Model definitions and weight loading for the worker runtime."""

from workers.models.arch_config import SUPPORTED_ARCHITECTURES, ArchConfig
from workers.models.base import CausalLM
from workers.models.loader import load_model
from workers.models.parallel import ParallelContext

__all__ = ["SUPPORTED_ARCHITECTURES", "ArchConfig", "CausalLM", "ParallelContext", "load_model"]
