"""Helpers for the model tests: tiny HF models, meta materialization, and a paged-KV driver."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dormant.layers.context import forward_context
from dormant.models import CausalLM, ModelConfig, build_model, iterate_safetensors
from tests.layers.attention_metadata import build_attention_metadata

VOCAB_SIZE = 256
HF_MODEL_CLASSES: dict[type[PretrainedConfig], type[PreTrainedModel]] = {
    LlamaConfig: LlamaForCausalLM,
    Qwen2Config: Qwen2ForCausalLM,
    Qwen3Config: Qwen3ForCausalLM,
    Qwen3MoeConfig: Qwen3MoeForCausalLM,
}


def llama_gqa_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )


def qwen3_config(*, tie_word_embeddings: bool) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden / heads, as in real Qwen3
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
    )


def qwen3_moe_config() -> Qwen3MoeConfig:
    """Every layer sparse: 8 experts, 2 per token, renormalised."""
    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
        initializer_range=0.1,
    )


def qwen3_moe_mixed_config() -> Qwen3MoeConfig:
    """A dense layer between two sparse ones (``mlp_only_layers``), 3 of 4 experts per token,
    not renormalised, tied embeddings."""
    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
        initializer_range=0.1,
    )


def make_hf_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A float32 HF model with seeded weights; norm weights (HF: ones) and biases (HF: zeros)
    are perturbed so the comparison exercises them."""
    torch.manual_seed(seed)
    model = HF_MODEL_CLASSES[type(config)](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.add_(0.1 * torch.randn_like(param))
    return model


def save_checkpoint(model: PreTrainedModel, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def load_dormant(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    """Builds the dormant model on ``meta``, materializes it, and loads the checkpoint."""
    config = dataclasses.replace(ModelConfig.from_pretrained(path), dtype=dtype)
    with torch.device("meta"):
        model = build_model(config)
    materialize(model, torch.device(device))
    model.init_buffers()
    model.reset_kv_scales()
    loaded = model.load_weights(iterate_safetensors(path))
    assert loaded == set(model.expected_weight_shapes())
    return model


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Swaps every parameter (keeping its identity and attributes) and buffer of a module built
    on ``meta`` for uninitialized tensors on ``device``, as the engine does with its allocator.

    ``param.data = t`` is refused across meta and a real device, so parameters are swapped with
    ``torch.utils.swap_tensors``, which also swaps ``__dict__``; the attributes (weight loaders)
    are copied onto the replacement first so the original object keeps them.
    """
    swapped: set[int] = set()
    for param in module.parameters():  # deduplicated: tied parameters once
        if id(param) in swapped:
            continue
        swapped.add(id(param))
        real = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device=device),
            requires_grad=param.requires_grad,
        )
        real.__dict__.update(param.__dict__)
        torch.utils.swap_tensors(param, real)
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                submodule._buffers[name] = torch.empty_like(buffer, device=device)


def hf_greedy(model: PreTrainedModel, prompt: list[int], num_steps: int) -> list[int]:
    """Greedy continuation by full recomputation (no HF cache involved)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_steps):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


class PagedRunner:
    """Drives a dormant model through its paged KV cache as the engine will: every sequence
    owns blocks drawn from a shuffled pool; each ``step`` appends new tokens to every
    sequence."""

    def __init__(
        self,
        model: CausalLM,
        num_seqs: int,
        max_seq_len: int,
        block_size: int,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        num_blocks_per_seq = math.ceil(max_seq_len / block_size)
        num_blocks = num_seqs * num_blocks_per_seq + 3  # a few blocks nobody owns
        device = next(model.parameters()).device
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        tables = order[: num_seqs * num_blocks_per_seq].view(num_seqs, num_blocks_per_seq)
        self.block_tables = tables.to(device=device, dtype=torch.int32)
        self.seq_lens = [0] * num_seqs
        for layer in model.attention_layers():
            shape = (2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            # NaN in every slot: a read of an unwritten slot poisons the output.
            cache = torch.full(shape, float("nan"), device=device)
            layer.kv_cache = cache.to(cache_dtype or model.config.dtype)

    @torch.no_grad()
    def step(self, new_tokens: list[list[int]]) -> list[Tensor]:
        """Runs one forward over every sequence's new tokens; returns each sequence's float32
        logits ``[len(new_tokens[s]), vocab]``."""
        device = self.block_tables.device
        query_lens = [len(tokens) for tokens in new_tokens]
        starts = self.seq_lens
        self.seq_lens = [s + q for s, q in zip(starts, query_lens, strict=True)]
        meta = build_attention_metadata(
            self.block_tables,
            torch.tensor(self.seq_lens),
            torch.tensor(query_lens),
            self.block_size,
        )
        positions = torch.cat(
            [torch.arange(s, e) for s, e in zip(starts, self.seq_lens, strict=True)]
        )
        input_ids = torch.tensor([t for tokens in new_tokens for t in tokens])
        with forward_context(meta):
            hidden = self.model(input_ids.to(device), positions.to(device))
        logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))
