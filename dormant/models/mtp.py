"""Multi-token prediction (MTP) layers as a speculative draft: Xiaomi MiMo's layout.

A MiMo checkpoint (``MiMoForCausalLM``, Qwen2's decoder) carries ``num_nextn_predict_layers``
MTP layers, ``model.mtp_layers.{i}.*``; each is one Qwen2 decoder layer fed by a projection of
the target's hidden state and the next token's embedding (vLLM's ``mimo_mtp.py``)::

    h = input_proj(cat[hidden_layernorm(previous_hidden), token_layernorm(embed(token))])
    h = final_layernorm(decoder_layer(h))        # input_layernorm, self_attn, mlp, residuals
    logits = lm_head(h)

The embedding and the LM head are the target's, shared by reference (a MiMo checkpoint has no
others): ``MTPDraft`` owns only the MTP layers' parameters, and a refit of the target's
embedding or head is the draft's too.

API (what the engine uses):

- ``num_mtp_layers(config)``: how many MTP layers a target's config carries in a layout this
  module builds (0: none, or not a supported family; ``MTP_ARCHITECTURES``).
- ``MTPDraft(config, embed_tokens, lm_head)``, or ``MTPDraft.for_target(target)``: built from
  the target's ``ModelConfig`` on the ambient device (``meta`` works), same lifecycle as
  ``CausalLM``: materialize → ``init_buffers()`` → ``reset_kv_scales()`` → ``load_weights`` or
  ``init_random_weights`` → set ``kv_cache`` on each of ``attention_layers()`` → ``forward``
  inside ``forward_context``.
- ``forward(input_ids [T], positions [T], previous_hidden [T, H], step=0) -> hidden [T, H]``.
  Row ``t`` pairs ``previous_hidden[t]``, the hidden state *at position* ``positions[t]`` (the
  target's ``forward`` output there, or the previous MTP step's ``forward`` output), with the
  embedding of ``input_ids[t]``, the token that *follows* it (at ``positions[t] + 1``); the
  row's logits predict the token at ``positions[t] + 2``. So, after a target forward over
  tokens ``x_0..x_{n-1}`` at positions ``p_0..p_{n-1}`` and the new token ``x_n``, the MTP runs
  on ``input_ids = x_1..x_n`` with the target's own positions, hidden states and attention
  metadata (slot mapping, block tables, sequence lengths): its KV for row ``t`` lands in the
  slot of ``positions[t]``, in the MTP layer's own cache, which shares the target's block
  tables. (Rotary attention is relative, so only the masking below depends on this
  convention.) As vLLM and SGLang do, rows at position 0 get a zero embedding.
  ``step`` picks layer ``step % num_layers`` (MiMo has one layer, reused for every step).
- ``compute_logits(hidden [T, H]) -> float32 [T, V]``: the shared LM head.
- ``load_weights(iterable of (name, tensor)) -> set[str]`` with the checkpoint's names
  (``model.mtp_layers.{i}.self_attn.q_proj.weight``, ...), as ``CausalLM.load_weights``
  (``weight_observer`` included); names outside ``model.mtp_layers.`` are refused with a
  ``WeightError`` (route names with ``is_mtp_weight``). ``check_weights``,
  ``expected_weight_shapes()`` (every name, full shapes) and ``weight_table()`` as
  ``CausalLM``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from dormant.layers.attention import PagedAttention
from dormant.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from dormant.layers.linear import ReplicatedLinear
from dormant.layers.norm import RMSNorm
from dormant.layers.rotary import RotaryEmbedding
from dormant.models import weights as weight_io
from dormant.models.base import CausalLM, WeightWriteObserver
from dormant.models.config import ModelConfig
from dormant.models.decoder import DecoderLayer, DecoderSpec
from dormant.models.errors import UnsupportedModelError, WeightError
from dormant.models.mimo import MTP_WEIGHT_PREFIX, MiMoForCausalLM, is_mtp_weight

# Architectures whose MTP layout this module builds, with their decoder's spec.
MTP_ARCHITECTURES: dict[str, type[CausalLM]] = {"MiMoForCausalLM": MiMoForCausalLM}
__all__ = ["MTP_ARCHITECTURES", "MTPDraft", "is_mtp_weight", "num_mtp_layers"]


def num_mtp_layers(config: ModelConfig) -> int:
    """The MTP layers ``config`` carries in a supported layout (0 when none or unsupported)."""
    if config.architecture not in MTP_ARCHITECTURES:
        return 0
    return config.num_nextn_predict_layers


@dataclass(frozen=True)
class SharedModules:
    """The target's modules the draft uses, held by reference outside the module tree (so
    ``parameters()`` and the weight table list only the draft's own)."""

    embed_tokens: VocabParallelEmbedding
    lm_head: ParallelLMHead


class MTPLayer(DecoderLayer):
    """One ``model.mtp_layers.{i}``: a decoder layer (its parameters under the same names as a
    target layer's) plus the input fusion and the final norm."""

    def __init__(
        self, config: ModelConfig, spec: DecoderSpec, layer_idx: int, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__(config, spec, layer_idx, rotary_emb)
        size, eps, dtype = config.hidden_size, config.rms_norm_eps, config.dtype
        self.token_layernorm = RMSNorm(size, eps, dtype=dtype)
        self.hidden_layernorm = RMSNorm(size, eps, dtype=dtype)
        self.input_proj = ReplicatedLinear(2 * size, size, bias=False, dtype=dtype)
        self.final_layernorm = RMSNorm(size, eps, dtype=dtype)

    def predict(self, positions: Tensor, embeds: Tensor, previous_hidden: Tensor) -> Tensor:
        """``[T, H]`` embeddings and previous hidden states → the layer's normed output."""
        fused = [self.hidden_layernorm(previous_hidden), self.token_layernorm(embeds)]
        hidden_states, residual = self(positions, self.input_proj(torch.cat(fused, -1)), None)
        return self.final_layernorm.add_and_norm(hidden_states, residual)[0]


class MTPLayers(nn.Module):
    """The ``model.`` level of the checkpoint's names: ``mtp_layers`` and their rotary table."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, num_layers: int) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        first = config.num_hidden_layers  # attention layer indices continue the target's
        self.mtp_layers = nn.ModuleList(
            MTPLayer(config, spec, first + i, self.rotary_emb) for i in range(num_layers)
        )


class MTPDraft(nn.Module):
    """The MTP layers of a target checkpoint, as a draft model (see the module for the API)."""

    def __init__(
        self, config: ModelConfig, embed_tokens: VocabParallelEmbedding, lm_head: ParallelLMHead
    ) -> None:
        super().__init__()
        num_layers = num_mtp_layers(config)
        if num_layers == 0:
            raise UnsupportedModelError(
                f"{config.architecture} with num_nextn_predict_layers="
                f"{config.num_nextn_predict_layers} has no MTP layers dormant can build; MTP "
                f"drafts need a checkpoint of {', '.join(MTP_ARCHITECTURES)} that carries them"
            )
        expected = (config.vocab_size, config.hidden_size)
        for name, module in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            shape = (module.num_embeddings, module.weight.shape[1])
            if shape != expected:
                raise ValueError(f"the target's {name} is {shape}, the config says {expected}")
        self.config = config
        spec = MTP_ARCHITECTURES[config.architecture].decoder_spec(config)
        self.model = MTPLayers(config, spec, num_layers)
        self.shared = SharedModules(embed_tokens, lm_head)
        self.weight_observer: WeightWriteObserver | None = None
        self._weight_table: dict[str, weight_io.WeightTarget] | None = None

    @classmethod
    def for_target(cls, target: CausalLM) -> MTPDraft:
        """The draft of ``target``'s checkpoint, sharing its embedding and LM head."""
        return cls(target.config, target.model.embed_tokens, target.lm_head)

    @property
    def num_layers(self) -> int:
        return len(self.model.mtp_layers)

    def forward(
        self, input_ids: Tensor, positions: Tensor, previous_hidden: Tensor, step: int = 0
    ) -> Tensor:
        """See the module: rows pair the hidden state at ``positions[t]`` with the embedding of
        the token after it. Runs inside ``forward_context``; writes this layer's KV."""
        embeds = self.shared.embed_tokens(input_ids)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        layer = cast(MTPLayer, self.model.mtp_layers[step % self.num_layers])
        return layer.predict(positions, embeds, previous_hidden)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """``[num_tokens, hidden]`` → float32 ``[num_tokens, vocab]`` (the target's head)."""
        return self.shared.lm_head(hidden_states)

    def attention_layers(self) -> list[PagedAttention]:
        """The MTP layers' attention, in layer order (one KV cache each)."""
        return [cast(MTPLayer, layer).self_attn.attn for layer in self.model.mtp_layers]

    def init_buffers(self) -> None:
        """Recomputes the rotary table in place (after materialization)."""
        self.model.rotary_emb.init_buffers()

    def reset_kv_scales(self) -> None:
        for layer in self.attention_layers():
            layer.reset_kv_scales()

    def weight_table(self) -> dict[str, weight_io.WeightTarget]:
        """Checkpoint name → where it lands, for the draft's own parameters only."""
        table = self._weight_table
        if table is None:
            table = weight_io.weight_targets(self, CausalLM.packed_modules_mapping)
            if not any(target.tensor.is_meta for target in table.values()):
                self._weight_table = table
        return table

    def expected_weight_shapes(self) -> dict[str, torch.Size]:
        """Checkpoint name → full shape of every MTP tensor (k/v scales, optional, omitted)."""
        return weight_io.expected_weight_shapes(self.weight_table())

    def check_weights(
        self,
        items: Sequence[tuple[str, torch.Size, torch.dtype]],
        *,
        require_complete: bool = False,
        exact_dtype: bool = False,
    ) -> None:
        """``CausalLM.check_weights`` for the MTP names; a target's name is a problem too."""
        _refuse_target_names(name for name, _, _ in items)
        weight_io.check_weights(self.weight_table(), False, items, require_complete, exact_dtype)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """``CausalLM.load_weights`` for the MTP names (the observer hears of every write);
        a name outside ``model.mtp_layers.`` raises ``WeightError`` when reached."""
        observer = self.weight_observer
        if observer is not None:
            observer.before_write()
        try:
            names = weight_io.load_weights(self.weight_table(), False, _own_names(weights))
        except BaseException:
            if observer is not None:
                observer.failed()
            raise
        if observer is not None:
            observer.written(names)
        return names

    def init_random_weights(self, seed: int) -> None:
        """As ``CausalLM.init_random_weights``, for the draft's own parameters."""
        if self.weight_observer is not None:
            self.weight_observer.before_write()
        weight_io.init_random_weights(self.weight_table(), seed)
        if self.weight_observer is not None:
            self.weight_observer.written(self.expected_weight_shapes())


_TARGET_NAME_HINT = (
    "The MTP draft holds only the checkpoint's model.mtp_layers.* tensors (it shares the "
    "target's embedding and LM head): load the other names into the target model "
    "(dormant.models.mtp.is_mtp_weight tells them apart)."
)


def _refuse_target_names(names: Iterable[str], outcome: str = "Nothing was written.") -> None:
    problem = f"not an MTP weight ({MTP_WEIGHT_PREFIX}*)"
    foreign = [f"{name}: {problem}" for name in names if not is_mtp_weight(name)]
    if foreign:
        raise WeightError(foreign, f"{_TARGET_NAME_HINT} {outcome}")


def _own_names(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``weights``, refusing a target's name when it is reached (the entries before it are
    written: ``check_weights`` first rejects a whole list without writing)."""
    for count, (name, tensor) in enumerate(weights):
        _refuse_target_names((name,), f"{count} earlier tensors were already written.")
        yield name, tensor
