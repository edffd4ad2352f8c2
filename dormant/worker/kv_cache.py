"""The paged KV cache: one backing allocation in the ``kv_cache`` tag, and nothing else there.

Layout: ``backing[layer, k|v, block, offset, kv_head, head_dim]``; layer ``i``'s attention gets
the view ``backing[i]``. This is the *only* allocation the engine makes in ``kv_cache`` (DESIGN §3
invariant 1): block tables, slot mappings and scales live in ``runtime``, so discarding the cache
at sleep loses KV data and nothing else, and waking it needs no recovery.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dormant.core.config import EngineConfig
from dormant.memory import KV_CACHE, MemoryManager
from dormant.models import CausalLM


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
