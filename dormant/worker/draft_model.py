"""The draft model of speculative decoding on one rank: its own ``CausalLM``, weights in the
``weights`` tag, and its own paged KV cache in ``kv_cache``.

The draft's KV cache has the target's block size and number of blocks and is indexed by the
target's block tables and slot mapping: the scheduler allocates blocks once, and a block's KV
budget is the target's plus the draft's (``kv_bytes_per_block``).

Refits. The draft's weights are named ``draft.<its checkpoint name>`` (``DRAFT_PREFIX``) in the
rank's ``RefitRecord``, beside the target's: a level-2 sleep makes them stale with the target's,
and generation is refused until both were written ("no stale draft"). ``reload_weights``
reloads the draft too: from the path given when the draft is the target itself
(self-speculation), else from its own checkpoint (or its seeded random init).
``update_weights`` and every other refit path take the draft's tensors under the prefix
(``weight_routes.py``), the target model object's ``load_weights`` included.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dormant.core.config import EngineConfig
from dormant.core.speculative_config import SpeculativeConfig
from dormant.memory import WEIGHTS, MemoryManager
from dormant.models import (
    CausalLM,
    build_model,
    iterate_safetensors,
    iterate_safetensors_metadata,
)
from dormant.worker.kv_cache import allocate_kv_cache, kv_cache_spec
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.refit_record import RefitRecord
from dormant.worker.weight_routes import WeightRoutes

DRAFT_PREFIX = "draft."


class PrefixedObserver:
    """The draft's ``weight_observer``: reports its writes to the rank's record, prefixed."""

    def __init__(self, record: RefitRecord) -> None:
        self.record = record

    def before_write(self) -> None:
        self.record.before_write()

    def written(self, names: Iterable[str]) -> None:
        self.record.written(DRAFT_PREFIX + name for name in names)

    def failed(self) -> None:
        self.record.failed()


class DraftModel:
    """The draft ``CausalLM`` of one rank (see the module docstring).

    ``lag`` is how far the draft's positions trail the target's (``worker/spec_step.py``): 0,
    a draft model reads tokens only (``MTPDraftModel``'s is 1)."""

    lag = 0
    hidden_cache: torch.Tensor | None = None  # MTP's; a draft model needs none

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, mm: MemoryManager) -> None:
        assert spec.draft_model_config is not None
        self.config, self.spec, self.mm = config, spec, mm
        with torch.device("meta"):
            model = build_model(spec.draft_model_config)
        mm.adopt(model, tag=WEIGHTS)  # parameters → weights, buffers → runtime
        model.init_buffers()
        model.reset_kv_scales()
        self.model = model

    @property
    def weight_names(self) -> tuple[str, ...]:
        """Its weights' names in the rank's refit record."""
        return tuple(DRAFT_PREFIX + name for name in self.model.expected_weight_shapes())

    def attach(self, record: RefitRecord) -> None:
        self.model.weight_observer = PrefixedObserver(record)

    def load(self, target_path: str | None = None) -> tuple[str, ...]:
        """Loads the draft's checkpoint (``target_path`` instead, under self-speculation when
        the target is reloaded from it), or re-runs its seeded random init; returns the
        prefixed names written."""
        spec, model = self.spec, self.model
        path = target_path if spec.is_self_speculation and target_path else spec.draft_path
        if path is None:
            model.init_random_weights(self.config.seed)
            return self.weight_names
        model.check_weights(list(iterate_safetensors_metadata(path)), require_complete=True)
        return tuple(
            sorted(DRAFT_PREFIX + n for n in model.load_weights(iterate_safetensors(path)))
        )

    def own_name(self, name: str) -> str | None:
        """The draft's name for a refit's ``draft.``-prefixed ``name`` (``weight_routes.py``);
        None for any other name (the target's)."""
        return name[len(DRAFT_PREFIX) :] if name.startswith(DRAFT_PREFIX) else None

    def recorded_name(self, name: str) -> str:
        return DRAFT_PREFIX + name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor | None,
        step: int,
    ) -> torch.Tensor:  # fmt: skip
        """One draft pass (inside ``forward_context``): final hidden states; ``previous`` and
        ``step`` are MTP's, unused here."""
        return self.model(input_ids, positions)

    def kv_bytes_per_block(self) -> int:
        return kv_cache_spec(self.model, self.config).bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return allocate_kv_cache(
            self.mm, self.model, kv_cache_spec(self.model, self.config), num_blocks
        )


def create_draft(
    config: EngineConfig, mm: MemoryManager, target: CausalLM
) -> DraftModel | MTPDraftModel | None:
    """The draft of ``config.speculative_config`` on this rank (None: no speculation): a draft
    model, or the target checkpoint's MTP layers (sharing ``target``'s embedding and head).
    ``target.load_weights`` routes the draft's names to it from then on (``WeightRoutes.attach``:
    frameworks refit both through the model object)."""
    spec = config.speculative_config
    if spec is None:
        return None
    draft: DraftModel | MTPDraftModel
    if spec.method == "mtp":
        draft = MTPDraftModel(config, spec, mm, target)
    else:
        draft = DraftModel(config, spec, mm)
    WeightRoutes(target, draft).attach()
    return draft
