"""Qwen3 (``Qwen3ForCausalLM``, dense)."""

from __future__ import annotations

from dormant.models.base import CausalLM
from dormant.models.config import ModelConfig
from dormant.models.decoder import DecoderSpec


class Qwen3ForCausalLM(CausalLM):
    """Per-head RMSNorm on q and k before rotary; ``attention_bias`` (off by default) covers
    q/k/v and o."""

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(
            has_qk_norm=True,
            has_qkv_bias=config.attention_bias,
            has_o_proj_bias=config.attention_bias,
            has_mlp_bias=False,
        )
