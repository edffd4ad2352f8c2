"""The decoder stack shared by Llama, Qwen2, Qwen3 and Qwen3-MoE (they differ only in
``DecoderSpec``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from dormant.layers.activation import SiluAndMul
from dormant.layers.attention import PagedAttention
from dormant.layers.embedding import VocabParallelEmbedding
from dormant.layers.kernels import IS_TRITON_AVAILABLE, is_power_of_two, use_triton
from dormant.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from dormant.layers.norm import RMSNorm
from dormant.layers.rotary import RotaryEmbedding
from dormant.models.config import ModelConfig

if IS_TRITON_AVAILABLE:
    from dormant.layers.triton_rotary import rotate_qk_


@dataclass(frozen=True)
class DecoderSpec:
    """The per-family differences of the decoder layer."""

    has_qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k, before rotary
    has_qkv_bias: bool
    has_o_proj_bias: bool
    has_mlp_bias: bool
    # Mixture-of-experts families: builds the MLP of the layers ``config.moe`` makes sparse.
    sparse_mlp: Callable[[ModelConfig], nn.Module] | None = None


class DecoderAttention(nn.Module):
    """Fused qkv projection, optional q/k norm, rotary, paged attention, output projection."""

    def __init__(
        self, config: ModelConfig, spec: DecoderSpec, layer_idx: int, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=spec.has_qkv_bias,
            dtype=config.dtype,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=spec.has_o_proj_bias,
            dtype=config.dtype,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.has_qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=config.dtype)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=config.dtype)
        self.rotary_emb = rotary_emb  # shared by all layers; owned by the model
        self.attn = PagedAttention(
            self.qkv_proj.local_num_heads,
            self.qkv_proj.local_num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            layer_idx=layer_idx,
        )

    def forward(self, positions: Tensor, hidden_states: Tensor) -> Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = self._normed_rotated_qkv(positions, qkv)
        return self.o_proj(self.attn(q, k, v))

    def _normed_rotated_qkv(self, positions: Tensor, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        head_dim = self.qkv_proj.head_dim
        if use_triton(qkv) and is_power_of_two(head_dim):  # one kernel for norms and rotary
            norm = None
            if self.q_norm is not None and self.k_norm is not None:
                norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            num_heads = (self.qkv_proj.local_num_heads, self.qkv_proj.local_num_kv_heads)
            rotate_qk_(qkv, positions, self.rotary_emb.cos_sin_cache, *num_heads, head_dim, norm)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            return q, k, v
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, q_size // head_dim, head_dim))
            k = self.k_norm(k.reshape(-1, kv_size // head_dim, head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class DecoderMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=spec.has_mlp_bias,
            dtype=config.dtype,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=spec.has_mlp_bias, dtype=config.dtype
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block. The residual add is fused into the following norm."""

    def __init__(
        self, config: ModelConfig, spec: DecoderSpec, layer_idx: int, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=config.dtype)
        self.self_attn = DecoderAttention(config, spec, layer_idx, rotary_emb)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=config.dtype
        )
        self.mlp: nn.Module
        if config.moe is not None and config.moe.is_sparse_layer(layer_idx):
            assert spec.sparse_mlp is not None, "a MoE family's spec builds its sparse MLP"
            self.mlp = spec.sparse_mlp(config)
        else:
            self.mlp = DecoderMLP(config, spec)

    def forward(
        self, positions: Tensor, hidden_states: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Returns ``(mlp_output, residual)``; their sum is the layer's output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.add_and_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(
            hidden_states, residual
        )
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` submodule)."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=config.dtype
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, self.rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=config.dtype)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if residual is None:  # a model with no layers
            return self.norm(hidden_states)
        return self.norm.add_and_norm(hidden_states, residual)[0]
