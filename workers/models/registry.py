"""Architecture name (``config.json`` "architectures") -> model class."""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

from workers.models.arch_config import SUPPORTED_ARCHITECTURES
from workers.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from workers.models.llama import LlamaForCausalLM, MistralForCausalLM
from workers.models.mixtral import MixtralForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.qwen2_moe import Qwen2MoeForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: MappingProxyType[str, type[nn.Module]] = MappingProxyType(
    {
        "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    }
)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for ``architecture``; ValueError listing the supported ones otherwise."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return MODEL_CLASSES[architecture]
