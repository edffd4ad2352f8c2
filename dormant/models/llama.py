"""Llama (``LlamaForCausalLM``)."""

from __future__ import annotations

from dormant.models.base import CausalLM
from dormant.models.config import ModelConfig
from dormant.models.decoder import DecoderSpec


class LlamaForCausalLM(CausalLM):
    """Llama 2/3: ``attention_bias`` covers q/k/v and o; ``mlp_bias`` gate/up/down."""

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(
            has_qk_norm=False,
            has_qkv_bias=config.attention_bias,
            has_o_proj_bias=config.attention_bias,
            has_mlp_bias=config.mlp_bias,
        )
