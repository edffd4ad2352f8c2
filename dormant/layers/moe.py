"""``FusedMoE``: every expert of one layer in two fused parameters, with their weight loader.

| parameter   | local shape        | holds (this rank's slice of I)              |
|-------------|--------------------|---------------------------------------------|
| w13_weight  | [E, 2 * I / tp, H] | expert e's gate rows, then its up rows      |
| w2_weight   | [E, H, I / tp]     | expert e's down projection                  |

Tensor parallelism is vLLM's TP-for-MoE: every rank holds every expert, sliced along the
intermediate dimension like a column-parallel gate/up and a row-parallel down, so one
all-reduce after the combine makes the output whole. Checkpoints name each expert apart
(Hugging Face's ``experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``), each a full
``[I, H]`` or ``[H, I]`` tensor; the loader copies this rank's slice into the fused tensors in
place, so their addresses never change. transformers 5 holds the experts fused in memory
(``experts.gate_up_proj [E, 2I, H]``, gate rows first, and ``experts.down_proj [E, H, I]``): a
trainer on it sends those names, which load too, as aliases of the per-expert names.

Routing results and the sorted pairs are per-step intermediates, like attention's: in the
CUDA-graph pool (``cuda_graph``) when captured, else transient; nothing persistent is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from dormant.distributed import get_tp_group
from dormant.layers.kernels import IS_TRITON_AVAILABLE, use_triton
from dormant.layers.moe_reference import fused_experts_reference, select_experts
from dormant.layers.weight_utils import ShardId, check_loaded_shape, divide, set_weight_attrs

if IS_TRITON_AVAILABLE:
    from dormant.layers.triton_moe import fused_experts
    from dormant.layers.triton_moe_routing import topk_softmax

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExpertShard(NamedTuple):
    """The shard id of one expert's checkpoint tensor: which expert, which projection."""

    expert: int
    projection: str


class FusedMoE(nn.Module):
    """The experts of one sparse layer: ``forward(hidden [T, H], router_logits [T, E])`` →
    ``[T, H]``, whole on every rank."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.world_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        local = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.local_intermediate_size = local
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, local, dtype=dtype), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            set_weight_attrs(param, self.weight_loader, self.loaded_shape)

    def checkpoint_weights(self) -> Iterator[tuple[str, nn.Parameter, ExpertShard]]:
        """(name relative to this module, parameter, shard id) of every checkpoint tensor, in
        expert order."""
        for expert in range(self.num_experts):
            for projection in PROJECTIONS:
                param = self.w2_weight if projection == "down_proj" else self.w13_weight
                yield f"{expert}.{projection}.weight", param, ExpertShard(expert, projection)

    def checkpoint_aliases(self) -> Iterator[tuple[str, nn.Parameter, str, tuple[str, ...]]]:
        """transformers 5's fused names: (name, parameter, shard id, the names it covers)."""
        experts = range(self.num_experts)
        gate_up = tuple(f"{e}.{p}.weight" for e in experts for p in ("gate_proj", "up_proj"))
        down = tuple(f"{e}.down_proj.weight" for e in experts)
        yield "gate_up_proj", self.w13_weight, "gate_up_proj", gate_up
        yield "down_proj", self.w2_weight, "down_proj", down

    def _shard(self, shard_id: ShardId | None) -> ExpertShard:
        if (
            not isinstance(shard_id, tuple)
            or len(shard_id) != 2
            or not isinstance(shard_id[0], int)
            or not 0 <= shard_id[0] < self.num_experts
            or shard_id[1] not in PROJECTIONS
        ):
            raise ValueError(
                f"shard id must be (expert in [0, {self.num_experts}), one of {PROJECTIONS}), "
                f"got {shard_id!r}"
            )
        return ExpertShard(*shard_id)

    def loaded_shape(self, param: Tensor, shard_id: ShardId | None = None) -> torch.Size:
        """``[I, H]`` for gate and up, ``[H, I]`` for down: one expert's full tensor; with a
        fused name, every expert's (``[E, 2I, H]``, ``[E, H, I]``)."""
        if shard_id == "gate_up_proj":
            return torch.Size((self.num_experts, 2 * self.intermediate_size, self.hidden_size))
        if shard_id == "down_proj":
            return torch.Size((self.num_experts, self.hidden_size, self.intermediate_size))
        shard = self._shard(shard_id)
        if shard.projection == "down_proj":
            return torch.Size((self.hidden_size, self.intermediate_size))
        return torch.Size((self.intermediate_size, self.hidden_size))

    def weight_loader(
        self, param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None
    ) -> None:
        check_loaded_shape(param, loaded_weight, self.loaded_shape(param, shard_id), shard_id)
        local, start = self.local_intermediate_size, self.tp_rank * self.local_intermediate_size
        if shard_id == "gate_up_proj":  # [E, gate I | up I, H]
            up_start = self.intermediate_size + start
            param.data[:, :local].copy_(loaded_weight[:, start : start + local])
            param.data[:, local:].copy_(loaded_weight[:, up_start : up_start + local])
            return
        if shard_id == "down_proj":
            param.data.copy_(loaded_weight[:, :, start : start + local])
            return
        shard = self._shard(shard_id)
        if shard.projection == "down_proj":
            param.data[shard.expert].copy_(loaded_weight.narrow(1, start, local))
            return
        offset = 0 if shard.projection == "gate_proj" else local
        destination = param.data[shard.expert].narrow(0, offset, local)
        destination.copy_(loaded_weight.narrow(0, start, local))

    def forward(self, hidden_states: Tensor, router_logits: Tensor) -> Tensor:
        if use_triton(hidden_states):
            weights, ids = topk_softmax(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(hidden_states, weights, ids)

    def forward_routed(
        self, hidden_states: Tensor, topk_weights: Tensor, topk_ids: Tensor
    ) -> Tensor:
        """The experts on routing done elsewhere (the fused router, ``triton_router.py``):
        float32 weights and int32 ids ``[T, top_k]``, as ``select_experts`` gives them."""
        if use_triton(hidden_states):
            out = fused_experts(
                hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids
            )
        else:
            out = fused_experts_reference(
                hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids
            )
        return self.tp_group.all_reduce(out) if self.tp_size > 1 else out
