"""The model configuration: frozen, validated, built once from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dormant.layers.rotary import Llama3RopeScaling
from dormant.models.errors import UnsupportedModelError
from dormant.models.moe_config import MOE_ARCHITECTURES, MoeConfig

# Qwen2's decoder: q/k/v biases always. MiMo is Qwen2 with MTP layers (``models/mtp.py``).
QWEN2_ARCHITECTURES = ("Qwen2ForCausalLM", "MiMoForCausalLM")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    *QWEN2_ARCHITECTURES,
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs from ``config.json``. Invariants are checked on construction.

    ``attention_bias`` means a bias on the q/k/v projections (and on o_proj for Llama and
    Qwen3; Qwen2 has q/k/v biases only and always sets it). ``moe`` is set exactly for the
    mixture-of-experts architectures (``MOE_ARCHITECTURES``); their dense layers, if any, use
    ``intermediate_size``. ``num_nextn_predict_layers`` is the checkpoint's count of multi-token
    prediction layers (HF's key; 0 without); ``models/mtp.py`` says which layouts it builds.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoeConfig | None = None
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        sizes = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_nextn_predict_layers < 0:
            raise ValueError(
                f"config num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype}")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(
                f"{self.architecture} {'needs' if self.moe is None else 'takes no'} MoE settings "
                "(ModelConfig.moe)"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Builds from a parsed ``config.json`` (HF 4.x or 5.x layout)."""
        architectures = d.get("architectures") or []
        if not architectures:
            raise UnsupportedModelError(
                f"config has no 'architectures' entry; expected one of {SUPPORTED_ARCHITECTURES}"
            )
        missing = [key for key in _REQUIRED_KEYS if d.get(key) is None]
        if missing:
            raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
        _reject_unsupported_features(d)
        architecture = architectures[0]
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or _exact_div(d["hidden_size"], num_heads, "hidden_size")
        rope_theta, rope_scaling = _parse_rope(d)
        eos = d.get("eos_token_id")
        eos_token_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            architecture=architecture,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d["max_position_embeddings"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=architecture in QWEN2_ARCHITECTURES
            or bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            dtype=_parse_dtype(d.get("dtype") or d.get("torch_dtype") or "bfloat16"),
            eos_token_ids=eos_token_ids,
            bos_token_id=d.get("bos_token_id"),
            moe=MoeConfig.from_dict(d) if architecture in MOE_ARCHITECTURES else None,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        with open(file) as f:
            return cls.from_dict(json.load(f))


def _exact_div(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}; set head_dim")
    return numerator // denominator


def _parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported model dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _reject_unsupported_features(d: Mapping[str, Any]) -> None:
    problems = []
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {d['hidden_act']!r} (only 'silu')")
    if d.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention)")
    if d.get("quantization_config") is not None:
        problems.append("quantization_config (quantized weights)")
    if problems:
        raise UnsupportedModelError(f"unsupported model features: {'; '.join(problems)}")


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Reads theta and scaling from HF 5.x ``rope_parameters`` or 4.x ``rope_theta`` +
    ``rope_scaling``."""
    params: dict[str, Any] = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    if any(isinstance(value, Mapping) for value in params.values()):
        raise UnsupportedModelError("per-layer-type rope parameters are not supported")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
        return theta, scaling
    raise UnsupportedModelError(
        f"unsupported rope scaling type {rope_type!r}; supported: 'default', 'llama3'"
    )
