"""RMSNorm, rotary embedding and SiluAndMul against Hugging Face."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from dormant.layers.activation import SiluAndMul
from dormant.layers.norm import RMSNorm
from dormant.layers.rotary import Llama3RopeScaling, RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_exact_with_hf(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = 1 + 0.1 * torch.randn(48, generator=generator)
    x = torch.randn(5, 3, 48, generator=generator).to(dtype)
    ours = RMSNorm(48, 1e-5, dtype=dtype)
    hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    assert torch.equal(ours(x), hf(x))
    residual = torch.randn(5, 3, 48, generator=generator).to(dtype)
    normed, new_residual = ours.add_and_norm(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, hf(residual + x))


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary_matches_hf(case: str) -> None:
    params = ROPE_CASES[case]
    head_dim, num_heads, max_pos = 32, 3, 256
    config = LlamaConfig(
        hidden_size=head_dim * num_heads,
        num_attention_heads=num_heads,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    scaling = None
    if case == "llama3":
        scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 32)
    ours = RotaryEmbedding(head_dim, max_pos, params["rope_theta"], scaling)
    hf = LlamaRotaryEmbedding(config)
    generator = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 5, 31, 64, 200, 255])
    q = torch.randn(7, num_heads * head_dim, generator=generator)
    k = torch.randn(7, 1, head_dim, generator=generator)
    q_ours, k_ours = ours(positions, q, k)
    cos, sin = hf(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(
        q.view(1, 7, num_heads, head_dim), k.view(1, 7, 1, head_dim), cos, sin, unsqueeze_dim=2
    )
    assert q_ours.shape == q.shape and k_ours.shape == k.shape
    assert torch.equal(q_ours, q_hf.reshape(q.shape))  # same float32 ops, bit for bit
    assert torch.equal(k_ours, k_hf.reshape(k.shape))


def test_rotary_cache_is_derived_and_recomputable() -> None:
    eager = RotaryEmbedding(16, 64, 10000.0)
    with torch.device("meta"):
        lazy = RotaryEmbedding(16, 64, 10000.0)
    assert lazy.cos_sin_cache.device.type == "meta"
    assert "cos_sin_cache" not in lazy.state_dict()  # non-persistent
    lazy._buffers["cos_sin_cache"] = torch.full_like(eager.cos_sin_cache, float("nan"))
    storage = lazy.cos_sin_cache.data_ptr()
    lazy.init_buffers()
    assert lazy.cos_sin_cache.data_ptr() == storage  # recomputed in place
    assert torch.equal(lazy.cos_sin_cache, eager.cos_sin_cache)


def test_silu_and_mul() -> None:
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])
