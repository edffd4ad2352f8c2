"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, and in the sparse layers a router
over ``num_experts`` experts of which each token uses ``num_experts_per_tok``.

Checkpoint names of a sparse layer's MLP (Hugging Face's, as ``save_pretrained`` writes them)::

    model.layers.{i}.mlp.gate.weight                     [E, H]   the router
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight    [I, H]   fused into experts.w13_weight
    model.layers.{i}.mlp.experts.{e}.up_proj.weight      [I, H]   fused into experts.w13_weight
    model.layers.{i}.mlp.experts.{e}.down_proj.weight    [H, I]   fused into experts.w2_weight

Dense layers (``mlp_only_layers``, ``decoder_sparse_step``) keep the dense names with
``intermediate_size``. No shared expert: Qwen3-MoE has none.
"""

from __future__ import annotations

from torch import Tensor, nn

from dormant.layers.linear import ReplicatedLinear
from dormant.layers.moe import FusedMoE
from dormant.models.base import CausalLM
from dormant.models.config import ModelConfig
from dormant.models.decoder import DecoderSpec


class SparseMoeBlock(nn.Module):
    """The router (replicated on every rank) and the fused experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "a sparse layer needs the config's MoE settings"
        self.gate = ReplicatedLinear(
            config.hidden_size, moe.num_experts, bias=False, dtype=config.dtype
        )
        self.experts = FusedMoE(
            moe.num_experts,
            moe.num_experts_per_tok,
            config.hidden_size,
            moe.moe_intermediate_size,
            renormalize=moe.norm_topk_prob,
            dtype=config.dtype,
        )

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``[T, H]`` → ``[T, H]``. The router's GEMM runs in the model dtype, as in HF and
        vLLM; its logits go to float32 for the softmax and top-k."""
        return self.experts(hidden_states, self.gate(hidden_states))


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3's per-head q/k norm; ``attention_bias`` (off by default) covers q/k/v and o."""

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(
            has_qk_norm=True,
            has_qkv_bias=config.attention_bias,
            has_o_proj_bias=config.attention_bias,
            has_mlp_bias=False,
            sparse_mlp=SparseMoeBlock,
        )
