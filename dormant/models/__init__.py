"""Models: configs, the ``CausalLM`` interface, Llama/Qwen families, checkpoint loading."""

from dormant.models.base import CausalLM
from dormant.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from dormant.models.errors import UnsupportedModelError, WeightError
from dormant.models.loader import iterate_safetensors, iterate_safetensors_metadata
from dormant.models.registry import MODEL_REGISTRY, build_model

__all__ = [
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "UnsupportedModelError",
    "WeightError",
    "build_model",
    "iterate_safetensors",
    "iterate_safetensors_metadata",
]
