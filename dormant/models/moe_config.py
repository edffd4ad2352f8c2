"""The mixture-of-experts part of a model configuration (Qwen3-MoE's ``config.json`` keys).

Which decoder layers are sparse follows Hugging Face's ``Qwen3MoeDecoderLayer`` exactly:

| layer ``i`` is                | when                                                         |
|-------------------------------|--------------------------------------------------------------|
| sparse (router + experts)     | ``i not in mlp_only_layers and (i + 1) % sparse_step == 0``  |
| dense (``intermediate_size``) | otherwise                                                    |

(``sparse_step`` is ``decoder_sparse_step``.)

Routing: softmax over the router's logits in float32, the top ``num_experts_per_tok`` experts,
their probabilities renormalised to sum to 1 when ``norm_topk_prob``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dormant.models.errors import UnsupportedModelError

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
# Hugging Face's Qwen3MoeConfig defaults, for keys a config.json leaves out.
_DEFAULTS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
}


@dataclass(frozen=True)
class MoeConfig:
    """Invariants (checked on construction): ``1 <= num_experts_per_tok <= num_experts``, every
    size positive, ``mlp_only_layers`` sorted and distinct."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                f"({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step} (a model "
                "without sparse layers is a dense Qwen3: use Qwen3ForCausalLM)"
            )
        if list(self.mlp_only_layers) != sorted(set(self.mlp_only_layers)):
            raise ValueError(f"mlp_only_layers must be sorted and distinct: {self.mlp_only_layers}")

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` routes to experts (see the module table)."""
        if layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MoeConfig:
        """Reads the MoE keys of a parsed ``config.json``; HF's defaults fill missing ones.

        ``num_local_experts`` is what transformers 5 writes for ``num_experts``.
        """
        get = lambda key: d[key] if d.get(key) is not None else _DEFAULTS[key]  # noqa: E731
        num_experts = d.get("num_experts", d.get("num_local_experts"))
        if d.get("shared_expert_intermediate_size"):
            raise UnsupportedModelError(
                "shared experts (shared_expert_intermediate_size) are not supported: that is "
                "Qwen2-MoE; dormant serves Qwen3-MoE"
            )
        return cls(
            num_experts=int(num_experts if num_experts is not None else _DEFAULTS["num_experts"]),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            decoder_sparse_step=int(get("decoder_sparse_step")),
            mlp_only_layers=tuple(sorted(set(d.get("mlp_only_layers") or ()))),
        )
