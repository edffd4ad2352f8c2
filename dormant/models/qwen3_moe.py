"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, and in the sparse layers a router
over ``num_experts`` experts of which each token uses ``num_experts_per_tok``.

Checkpoint names of a sparse layer's MLP (Hugging Face's, as ``save_pretrained`` writes them)::

    model.layers.{i}.mlp.gate.weight                     [E, H]   the router
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight    [I, H]   fused into experts.w13_weight
    model.layers.{i}.mlp.experts.{e}.up_proj.weight      [I, H]   fused into experts.w13_weight
    model.layers.{i}.mlp.experts.{e}.down_proj.weight    [H, I]   fused into experts.w2_weight

Dense layers (``mlp_only_layers``, ``decoder_sparse_step``) keep the dense names with
``intermediate_size``. No shared expert: Qwen3-MoE has none.

Routing on the GPU: up to ``FUSED_ROUTER_MAX_TOKENS`` tokens (decode), one kernel computes the
router's logits, softmax and top-k (``layers/triton_router.py``), with a ticket that is the
layer's one persistent routing state (``router_ticket``, a buffer: ``runtime``, zero between
launches, set by ``init_buffers``); more tokens, and the CPU, run the router's GEMM, then the
top-k (``FusedMoE.forward``). The attention projections keep cuBLAS; at one token they take the
PDL GEMV (``triton_gemv.pdl_linear``) while ``triton_gemv.USE_PDL_AT_BATCH_1`` is set
(``Qwen3MoeForCausalLM``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from dormant.layers.kernels import IS_TRITON_AVAILABLE, use_triton
from dormant.layers.linear import ReplicatedLinear
from dormant.layers.moe import FusedMoE
from dormant.models.base import CausalLM
from dormant.models.config import ModelConfig
from dormant.models.decoder import DecoderLayer, DecoderSpec

if IS_TRITON_AVAILABLE:
    from dormant.layers.triton_router import is_router_fused, router_topk


class SparseMoeBlock(nn.Module):
    """The router (replicated on every rank) and the fused experts."""

    router_ticket: Tensor

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
        # The fused router's ticket: derived state (zero at rest), not a checkpoint tensor.
        ticket = torch.zeros(1, dtype=torch.int32)
        self.register_buffer("router_ticket", ticket, persistent=False)

    def init_buffers(self) -> None:
        """Zeroes the ticket in place (after materialization: adopted buffers start undefined)."""
        self.router_ticket.zero_()

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``[T, H]`` → ``[T, H]``. The router's GEMM runs in the model dtype, as in HF and
        vLLM; its logits go to float32 for the softmax and top-k."""
        experts = self.experts
        if use_triton(hidden_states) and is_router_fused(hidden_states.shape[0]):
            weights, ids, _ = router_topk(
                hidden_states, self.gate.weight, experts.top_k, experts.renormalize,
                self.router_ticket,
            )  # fmt: skip
            return experts.forward_routed(hidden_states, weights, ids)
        return experts(hidden_states, self.gate(hidden_states))


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3's per-head q/k norm; ``attention_bias`` (off by default) covers q/k/v and o.

    Its attention projections keep cuBLAS: the skinny GEMV (``layers/triton_gemv.py``, opted in
    per layer with ``enable_skinny_gemv``) measured slower at batch 1 on the H200 (9.8 us per
    projection against cuBLAS's 7.8 us QKV and 6.9 + 1.7 us O; 2026-12-02c run 5). They are
    opted in to the PDL GEMV (``enable_pdl_gemv``), which runs only while
    ``triton_gemv.USE_PDL_AT_BATCH_1`` is set (the default)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            attention = cast(DecoderLayer, layer).self_attn
            attention.qkv_proj.enable_pdl_gemv()
            attention.o_proj.enable_pdl_gemv()

    @classmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(
            has_qk_norm=True,
            has_qkv_bias=config.attention_bias,
            has_o_proj_bias=config.attention_bias,
            has_mlp_bias=False,
            sparse_mlp=SparseMoeBlock,
        )

    def init_buffers(self) -> None:
        """The rotary tables, and every sparse layer's router ticket."""
        super().init_buffers()
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.init_buffers()
