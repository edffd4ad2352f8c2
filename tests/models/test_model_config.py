"""``ModelConfig`` parsing and validation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import llama_gqa_config, qwen3_config

from dormant.layers.rotary import Llama3RopeScaling
from dormant.models import (
    MODEL_REGISTRY,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
    build_model,
)


def _llama_dict(**overrides: Any) -> dict[str, Any]:
    d = llama_gqa_config().to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    d.update(overrides)
    return d


def test_llama_from_hf5_dict() -> None:
    config = ModelConfig.from_dict(_llama_dict())
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 16)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 16)
    assert config.eos_token_ids == (2, 3) and config.bos_token_id == 1
    assert config.dtype == torch.bfloat16  # HF wrote no dtype: the default
    assert not config.tie_word_embeddings and not config.attention_bias


def test_qwen3_explicit_head_dim_and_tied() -> None:
    d = qwen3_config(tie_word_embeddings=True).to_dict()
    d.update(architectures=["Qwen3ForCausalLM"], dtype="float32", eos_token_id=7)
    config = ModelConfig.from_dict(d)
    assert config.head_dim == 32 and config.hidden_size == 64
    assert config.tie_word_embeddings and config.dtype == torch.float32
    assert config.eos_token_ids == (7,)


def test_legacy_hf4_rope_keys_and_torch_dtype() -> None:
    d = _llama_dict(torch_dtype="float16", rope_theta=1234.0)
    del d["rope_parameters"]
    assert ModelConfig.from_dict(d).rope_scaling is None
    d["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = ModelConfig.from_dict(d)
    assert config.rope_theta == 1234.0 and config.dtype == torch.float16
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)


def test_qwen2_always_has_qkv_bias() -> None:
    config = ModelConfig.from_dict(_llama_dict(architectures=["Qwen2ForCausalLM"]))
    assert config.attention_bias


def test_from_pretrained_reads_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_llama_dict()))
    assert ModelConfig.from_pretrained(tmp_path) == ModelConfig.from_dict(_llama_dict())


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, UnsupportedModelError, "LlamaForCausalLM"),
        ({"architectures": None}, UnsupportedModelError, "architectures"),
        ({"num_key_value_heads": 3}, ValueError, "multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModelError, "yarn"),
        ({"dtype": "int8"}, ValueError, "unsupported model dtype"),
        ({"vocab_size": None}, ValueError, "vocab_size"),
        ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModelError, "quantized"),
    ],
)
def test_invalid_configs_raise(overrides: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ModelConfig.from_dict(_llama_dict(**overrides))


def test_config_is_frozen_and_revalidated_on_replace() -> None:
    config = ModelConfig.from_dict(_llama_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.vocab_size = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_attention_heads"):
        dataclasses.replace(config, num_key_value_heads=3)


def test_registry_covers_supported_architectures() -> None:
    assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES
    for architecture in SUPPORTED_ARCHITECTURES:
        config = ModelConfig.from_dict(_llama_dict(architectures=[architecture]))
        with torch.device("meta"):
            model = build_model(config)
        assert type(model).__name__ == architecture
