"""Speculative decoding's MTP draft on one rank: the target checkpoint's multi-token prediction
layers (``models/mtp.py``, Xiaomi MiMo's layout), sharing the target's embedding and LM head.

Its row at position ``p`` pairs the target's hidden state at ``p`` with the token at ``p + 1``,
so it trails the target by one position (``lag = 1``), and it reads the target's hidden states
of earlier steps: the **hidden cache**, one pre-norm hidden state per KV slot
(``[num_blocks, block_size, hidden]``, in ``kv_cache`` with the MTP layers' own KV, indexed by
the target's block tables). The target's pass of every step writes it at its slot mapping; like
KV, entries at rejected positions are stale past the sequence's length and overwritten later.

Refits. Its weights keep their checkpoint names (``model.mtp_layers.*``) in the rank's
``RefitRecord``: a level-2 sleep makes them stale with the target's; ``reload_weights`` reloads
them from the target's checkpoint; ``update_weights`` and every other refit path route those
names to it (``weight_routes.py``). The embedding and head are the target's tensors, so
refitting the target refits them for the draft too.
"""

from __future__ import annotations

from typing import cast

import torch

from dormant.core.config import EngineConfig
from dormant.core.speculative_config import SpeculativeConfig
from dormant.memory import KV_CACHE, WEIGHTS, MemoryManager
from dormant.models import CausalLM, iterate_safetensors, iterate_safetensors_metadata
from dormant.models.mtp import MTPDraft, is_mtp_weight
from dormant.worker.kv_cache import allocate_kv_cache, kv_cache_spec
from dormant.worker.refit_record import RefitRecord


class MTPDraftModel:
    """The MTP layers of the target's checkpoint, as this rank's draft (see the module)."""

    lag = 1

    def __init__(
        self, config: EngineConfig, spec: SpeculativeConfig, mm: MemoryManager, target: CausalLM
    ) -> None:
        self.config, self.spec, self.mm = config, spec, mm
        with torch.device("meta"):
            model = MTPDraft(target.config, target.model.embed_tokens, target.lm_head)
        mm.adopt(model, tag=WEIGHTS)  # its own parameters only: the shared ones are the target's
        model.init_buffers()
        model.reset_kv_scales()
        self.model = model
        self.hidden_cache: torch.Tensor | None = None

    @property
    def weight_names(self) -> tuple[str, ...]:
        return tuple(self.model.expected_weight_shapes())

    def attach(self, record: RefitRecord) -> None:
        self.model.weight_observer = record

    def load(self, target_path: str | None = None) -> tuple[str, ...]:
        """Loads the MTP layers from the target's checkpoint (``target_path``, or the
        engine's), or re-runs their seeded random init; returns the names written."""
        model, path = self.model, target_path or self.config.model
        if self.config.load_format == "dummy" or path is None:
            model.init_random_weights(self.config.seed)
            return self.weight_names
        items = [i for i in iterate_safetensors_metadata(path) if is_mtp_weight(i[0])]
        model.check_weights(items, require_complete=True)
        weights = ((n, t) for n, t in iterate_safetensors(path) if is_mtp_weight(n))
        return tuple(sorted(model.load_weights(weights)))

    def own_name(self, name: str) -> str | None:
        """A refit's MTP names (``model.mtp_layers.*``) are the draft's, as they are
        (``weight_routes.py``); None for any other name (the target's)."""
        return name if is_mtp_weight(name) else None

    def recorded_name(self, name: str) -> str:
        return name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None,
        step: int,
    ) -> torch.Tensor:  # fmt: skip
        """One MTP pass (inside ``forward_context``): ``previous`` holds the hidden state at
        each row's position (the target's, or the previous MTP pass's)."""
        assert previous is not None
        return self.model(input_ids, positions, previous, step)

    def kv_bytes_per_block(self) -> int:
        spec = kv_cache_spec(cast(CausalLM, self.model), self.config)
        hidden = self.model.config.hidden_size * self.model.config.dtype.itemsize
        return spec.bytes_per_block + self.config.block_size * hidden

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """The MTP layers' KV and the hidden cache, both backing memory in ``kv_cache``."""
        config = self.model.config
        model = cast(CausalLM, self.model)
        backing = allocate_kv_cache(self.mm, model, kv_cache_spec(model, self.config), num_blocks)
        shape = (num_blocks, self.config.block_size, config.hidden_size)
        self.hidden_cache = self.mm.empty(shape, config.dtype, tag=KV_CACHE)
        return backing
