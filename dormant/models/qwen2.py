"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``)."""

from __future__ import annotations

from dormant.models.base import CausalLM
from dormant.models.config import ModelConfig
from dormant.models.decoder import DecoderSpec


class Qwen2ForCausalLM(CausalLM):
    """Biases on q/k/v only (always), no o_proj bias, no q/k norm."""

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(
            has_qk_norm=False, has_qkv_bias=True, has_o_proj_bias=False, has_mlp_bias=False
        )
