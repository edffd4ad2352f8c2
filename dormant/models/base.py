"""``CausalLM``: the interface every model offers the engine, and its shared implementation.

Lifecycle: build (possibly under ``with torch.device("meta"):``) → materialize parameters and
buffers (swap in real tensors) → ``init_buffers()`` → ``reset_kv_scales()`` unless the
checkpoint provides scales → ``load_weights(...)`` or ``init_random_weights(seed)`` → set
``kv_cache`` on each of ``attention_layers()`` → ``forward`` inside ``forward_context``.

``parameters()`` yields exactly the checkpoint's parameters (tied embeddings once); derived
state (the rotary table) and calibrated state (k/v scales) are buffers.

Refits through the model object. Frameworks write weights with ``model.load_weights(...)`` on
the object itself (TRL colocate: ``...driver_worker.model_runner.model``; OpenRLHF's and verl's
worker extensions: ``self.model_runner.model``). Where the rank has more than this model to
refit (speculative decoding's draft), the worker sets ``weight_router`` (``create_draft``), and
``load_weights`` hands the names to it; the model's own writes are ``load_own_weights``, which
every path inside the engine calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol, cast

import torch
from torch import Tensor, nn

from dormant.layers.attention import PagedAttention
from dormant.layers.embedding import ParallelLMHead
from dormant.layers.rotary import RotaryEmbedding
from dormant.models import weights as weight_io
from dormant.models.config import ModelConfig
from dormant.models.decoder import DecoderLayer, DecoderModel, DecoderSpec


class WeightWriteObserver(Protocol):
    """Told about every weight write, so that no refit path is invisible to it.
    ``before_write`` runs first and may refuse the write by raising (nothing is written)."""

    def before_write(self) -> None: ...
    def written(self, names: Iterable[str]) -> None: ...
    def failed(self) -> None: ...


class WeightRouter(Protocol):
    """Takes a model object's ``load_weights`` over (``worker/weight_routes.py``): validates
    every name against the model it belongs to, then writes each there (this model's through
    ``load_own_weights``); returns the names written, as the rank's refit record has them."""

    def route_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]: ...


class CausalLM(nn.Module, ABC):
    """A decoder-only language model with HF-compatible weight names.

    Subclasses only choose their ``DecoderSpec`` via ``decoder_spec``.
    """

    # checkpoint module name -> (our fused module, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.decoder_spec(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=config.dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.weight_observer: WeightWriteObserver | None = None
        self.weight_router: WeightRouter | None = None  # set with a draft (create_draft)
        self._weight_table: dict[str, weight_io.WeightTarget] | None = None

    @classmethod
    @abstractmethod
    def decoder_spec(cls, config: ModelConfig) -> DecoderSpec:
        """The family's decoder differences, given the config."""

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """int64 ``input_ids``/``positions`` ``[num_tokens]`` → final hidden states
        ``[num_tokens, hidden]``. Runs inside ``forward_context``; writes the new tokens'
        keys and values into the KV cache."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """``[num_tokens, hidden]`` → float32 ``[num_tokens, vocab]`` (full vocab on all ranks)."""
        return self.lm_head(hidden_states)

    def attention_layers(self) -> list[PagedAttention]:
        """The attention layers in layer order (one KV cache each)."""
        return [cast(DecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def init_buffers(self) -> None:
        """Recomputes every derived buffer in place: the rotary tables and the attention layers'
        merge tickets. k/v scales are calibrated state and are left alone (see
        ``reset_kv_scales``)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding | PagedAttention):
                module.init_buffers()

    def reset_kv_scales(self) -> None:
        """Sets all k/v cache scales to 1.0 in place (once, after materialization)."""
        for layer in self.attention_layers():
            layer.reset_kv_scales()

    def weight_table(self) -> dict[str, weight_io.WeightTarget]:
        """Checkpoint name → where it lands. Kept once no target is on the meta device:
        materialising swaps parameter data in place (identity kept) and replaces buffers once,
        before any load; after that the table never changes."""
        table = self._weight_table
        if table is None:
            table = weight_io.weight_targets(self, self.packed_modules_mapping)
            if not any(target.tensor.is_meta for target in table.values()):
                self._weight_table = table
        return table

    def expected_weight_shapes(self) -> dict[str, torch.Size]:
        """Checkpoint name → full (unsharded) shape of every tensor a complete checkpoint
        provides, in module order; the optional k/v scales are not listed."""
        return weight_io.expected_weight_shapes(self.weight_table())

    def check_weights(
        self,
        items: Sequence[tuple[str, torch.Size, torch.dtype]],
        *,
        require_complete: bool = False,
        exact_dtype: bool = False,
    ) -> None:
        """Validates checkpoint names, full shapes and dtypes without writing anything.

        Raises ``WeightError`` naming every bad entry (and, with ``require_complete``, every
        missing required name). Any float dtype is accepted (cast on copy) unless
        ``exact_dtype``, which requires each tensor's dtype to equal its target's.
        """
        weight_io.check_weights(
            self.weight_table(),
            self.config.tie_word_embeddings,
            items,
            require_complete,
            exact_dtype,
        )

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """vLLM's ``model.load_weights``, what frameworks call on the model object:
        ``load_own_weights``, or, where the worker set a ``weight_router`` (a draft to refit
        beside this model), the router's ``route_weights`` (see the module)."""
        if self.weight_router is not None:
            return self.weight_router.route_weights(weights)
        return self.load_own_weights(weights)

    def load_own_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copies HF-named full tensors into the parameters in place (dtype cast on copy);
        returns the names written. Ignored names (``rotary_emb.inv_freq``; ``lm_head.weight``
        of a tied model) are skipped and not returned. ``weight_observer`` hears of every
        write, and of a failure partway (after which values may be mixed); its
        ``before_write`` may refuse the whole call first (the weights asleep)."""
        observer = self.weight_observer
        if observer is not None:
            observer.before_write()  # a refusal writes nothing and marks nothing stale
        try:
            names = weight_io.load_weights(
                self.weight_table(), self.config.tie_word_embeddings, weights
            )
        except BaseException:
            if observer is not None:
                observer.failed()
            raise
        if observer is not None:
            observer.written(names)
        return names

    def init_random_weights(self, seed: int) -> None:
        """Deterministic in-place init: N(0, 0.02) matrices/embeddings, ones for norm
        weights, zeros for biases; identical across TP sizes. Writes every weight."""
        if self.weight_observer is not None:
            self.weight_observer.before_write()
        weight_io.init_random_weights(self.weight_table(), seed)
        if self.weight_observer is not None:
            self.weight_observer.written(self.expected_weight_shapes())
