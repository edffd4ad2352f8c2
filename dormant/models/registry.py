"""Architecture name → model class, and the factory."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dormant.models.base import CausalLM
from dormant.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from dormant.models.errors import UnsupportedModelError
from dormant.models.llama import LlamaForCausalLM
from dormant.models.mimo import MiMoForCausalLM
from dormant.models.qwen2 import Qwen2ForCausalLM
from dormant.models.qwen3 import Qwen3ForCausalLM
from dormant.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: Mapping[str, type[CausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "MiMoForCausalLM": MiMoForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    }
)
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES


def build_model(config: ModelConfig) -> CausalLM:
    """Builds the model for ``config.architecture`` on the ambient default device (use
    ``with torch.device("meta"):`` to defer allocation) and TP group. Parameters are
    uninitialized until loaded or randomly initialized."""
    model_class = MODEL_REGISTRY.get(config.architecture)
    if model_class is None:
        raise UnsupportedModelError(
            f"no model for architecture {config.architecture!r}; supported: "
            f"{', '.join(MODEL_REGISTRY)}"
        )
    return model_class(config)
