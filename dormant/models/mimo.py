"""Xiaomi MiMo (``MiMoForCausalLM``): Qwen2 whose checkpoint also carries multi-token prediction
layers, ``model.mtp_layers.{i}.*``, which ``models/mtp.py``'s ``MTPDraft`` builds and loads.

Two differences from ``Qwen2ForCausalLM``, both vLLM's:

- ``forward`` returns the last layer's output *before* the final norm, and ``compute_logits``
  applies the norm. The MTP layers were trained on that pre-norm state (they norm it themselves,
  ``hidden_layernorm``), so the target's ``forward`` output is exactly what ``MTPDraft.forward``
  takes as ``previous_hidden``. Logits are unchanged: ``lm_head(norm(h))`` either way.
- The MTP names in a checkpoint are accepted and skipped by the target's ``load_own_weights``
  and ``check_weights`` (they are the draft's: ``mtp.is_mtp_weight``), so the target loads from
  a full MiMo checkpoint with speculation on or off. With MTP speculation on, the model object's
  ``load_weights`` routes them to the MTP layers (``CausalLM.weight_router``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from dormant.models.qwen2 import Qwen2ForCausalLM

MTP_WEIGHT_PREFIX = "model.mtp_layers."


def is_mtp_weight(name: str) -> bool:
    """Whether a checkpoint name belongs to the MTP layers (the draft), not the target."""
    return name.startswith(MTP_WEIGHT_PREFIX)


class MiMoForCausalLM(Qwen2ForCausalLM):
    """Qwen2 returning pre-norm hidden states; MTP weights skipped (see the module)."""

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Like ``CausalLM.forward``, but the final hidden states are not normed: the sum of the
        last layer's output and its residual (``compute_logits`` norms them)."""
        model = self.model
        hidden_states = model.embed_tokens(input_ids)
        residual: Tensor | None = None
        for layer in model.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states if residual is None else hidden_states + residual

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """Pre-norm ``[num_tokens, hidden]`` → float32 ``[num_tokens, vocab]``."""
        return self.lm_head(self.model.norm(hidden_states))

    def load_own_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """``CausalLM.load_own_weights`` of the non-MTP entries; MTP names are skipped (with an
        MTP draft, the worker's ``weight_router`` sends them to it first)."""
        return super().load_own_weights((n, t) for n, t in weights if not is_mtp_weight(n))

    def check_weights(
        self,
        items: Sequence[tuple[str, torch.Size, torch.dtype]],
        *,
        require_complete: bool = False,
        exact_dtype: bool = False,
    ) -> None:
        """``CausalLM.check_weights`` of the non-MTP entries; MTP names are skipped."""
        super().check_weights(
            [item for item in items if not is_mtp_weight(item[0])],
            require_complete=require_complete,
            exact_dtype=exact_dtype,
        )
