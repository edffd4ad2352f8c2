"""A tiny Qwen3-MoE checkpoint for engine tests, written by transformers' own ``save_pretrained``
(so the names are the per-expert names real checkpoints carry), with a tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from dormant.models import iterate_safetensors
from tests.engine.conftest import write_tokenizer


def moe_hf_config(**overrides: object):
    """Three layers: sparse, dense (``mlp_only_layers``), sparse; 8 experts, 2 per token."""
    from transformers import Qwen3MoeConfig

    options = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        torch_dtype="float32",
        eos_token_id=511,
        architectures=["Qwen3MoeForCausalLM"],
    )
    options.update(overrides)
    return Qwen3MoeConfig(**options)


def hf_moe_model(seed: int, **overrides: object):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(moe_hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # random norms, so every weight matters
                param.uniform_(0.5, 1.5)
    return model


def write_moe_checkpoint(
    path: Path, seed: int, with_tokenizer: bool = True, **overrides: object
) -> Path:
    """``overrides`` change ``moe_hf_config``'s sizes."""
    path.mkdir(parents=True, exist_ok=True)
    hf_moe_model(seed, **overrides).save_pretrained(path)
    if with_tokenizer:
        write_tokenizer(path)
    return path


def moe_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under their HF names (per expert), as a trainer sends them."""
    return dict(iterate_safetensors(path))
