"""The paged KV cache: one backing allocation in the ``kv_cache`` tag, and nothing else there.

Layout: ``backing[layer, k|v, block, offset, kv_head, head_dim]``; layer ``i``'s attention gets
the view ``backing[i]``. This is the *only* allocation the engine makes in ``kv_cache`` (DESIGN §3
invariant 1): block tables, slot mappings and scales live in ``runtime``, so discarding the cache
at sleep loses KV data and nothing else, and waking it needs no recovery. ``num_local_blocks``
sizes it on one rank (the engine takes the MIN over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dormant.core.config import EngineConfig
from dormant.memory import KV_CACHE, MemoryManager
from dormant.models import CausalLM

DEFAULT_HOST_KV_BYTES = 64 << 20  # the KV cache's size on the host backend, unless configured


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one block across all layers, on this rank."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # local to this tensor-parallel rank
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * self.dtype.itemsize

    def num_blocks_for(self, budget_bytes: int) -> int:
        return max(budget_bytes, 0) // self.bytes_per_block


def kv_cache_spec(model: CausalLM, config: EngineConfig) -> KVCacheSpec:
    layers = model.attention_layers()
    return KVCacheSpec(
        num_layers=len(layers),
        block_size=config.block_size,
        num_kv_heads=layers[0].num_kv_heads,
        head_dim=layers[0].head_dim,
        dtype=config.cache_dtype,
    )


def allocate_kv_cache(
    mm: MemoryManager, model: CausalLM, spec: KVCacheSpec, num_blocks: int
) -> torch.Tensor:
    """Allocates the backing (declared, explicit) and attaches each layer's view. Done once: the
    views' addresses are what captured graphs read, so they are never replaced."""
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    backing = mm.empty(shape, spec.dtype, tag=KV_CACHE)
    for layer, view in zip(model.attention_layers(), backing, strict=True):
        layer.kv_cache = view
    return backing


def num_local_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int) -> int:
    """KV blocks that fit on this rank: the configured count or bytes, else a fixed budget on
    the host, else what ``gpu_memory_utilization`` leaves free after the activations' headroom."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory_bytes is not None:
        return max(config.kv_cache_memory_bytes, 0) // bytes_per_block
    if device.type != "cuda":
        return DEFAULT_HOST_KV_BYTES // bytes_per_block
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1.0 - config.gpu_memory_utilization) * total - activation_bytes(config)
    return max(int(budget), 0) // bytes_per_block


def activation_bytes(config: EngineConfig) -> int:
    """Headroom kept free for activations, logits and the reference attention's scores."""
    c, m = config, config.model_config
    tokens = c.max_num_batched_tokens
    per_token = (4 * m.hidden_size + 3 * m.intermediate_size) * m.dtype.itemsize * 2
    scores = tokens * m.num_attention_heads * c.max_model_len * 4 * 2
    logits = c.max_num_seqs * m.vocab_size * 4 * 4
    return tokens * per_token + scores + logits
