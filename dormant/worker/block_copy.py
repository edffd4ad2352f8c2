"""Copies whole KV blocks within this rank's caches: the one copy-on-write of forks
(``StepInput.block_copies``: a leader's partial last block into its sibling's own block).

Every cache that the block tables index is registered here: the target's attention layers
(``[2, num_blocks, block_size, kv_heads, head_dim]``, blocks on dimension 1) and a speculative
draft's (its layers, and MTP's hidden cache ``[num_blocks, block_size, hidden]``, blocks on
dimension 0). A copy must run after the forward that wrote its source block and before the
forward that writes its destination (the scheduler's copy invariant): the runner runs it right
after the step's forward, on the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from dormant.worker.input_buffers import Staging

CacheView = tuple[torch.Tensor, int]  # a cache and its block dimension


class BlockCopier:
    """The caches of this rank, found through ``sources`` (called at each copy, so a cache
    is read where it lives now; its address never changes)."""

    def __init__(self, device: torch.device) -> None:
        self._staging = Staging(device)
        self._sources: list[Callable[[], Sequence[CacheView]]] = []

    def register(self, caches: Callable[[], Sequence[CacheView]]) -> None:
        """Adds a source of caches (the target's, a draft's)."""
        self._sources.append(caches)

    def copy(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies block ``source`` into block ``destination`` for each pair, in every cache.
        Precondition: no destination is a source (forks copy into fresh blocks)."""
        if not copies:
            return
        pairs = np.asarray(copies, dtype=np.int64).reshape(-1, 2)
        (sources, destinations), _ = self._staging.stage([pairs[:, 0], pairs[:, 1]])
        for caches in self._sources:
            for cache, dim in caches():
                data = cache.view(torch.uint8) if cache.element_size() == 1 else cache
                data.index_copy_(dim, destinations, data.index_select(dim, sources))
