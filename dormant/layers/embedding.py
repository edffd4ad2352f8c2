"""Vocabulary-parallel embedding and LM head.

Rank r holds rows ``[r * vocab / tp, (r + 1) * vocab / tp)`` of the ``[vocab, hidden]`` table.
The vocabulary must divide evenly by the TP size (no padding rows: the parameter is exactly
this rank's slice of the checkpoint tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dormant.distributed import get_tp_group
from dormant.layers.weight_utils import (
    ShardId,
    check_loaded_shape,
    check_no_shard_id,
    divide,
    load_narrowed,
    set_weight_attrs,
)


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary; lookups are summed over ranks."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.world_size
        self.num_embeddings = num_embeddings
        self.local_num_embeddings = divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start = self.tp_rank * self.local_num_embeddings
        self.weight = nn.Parameter(
            torch.empty(self.local_num_embeddings, embedding_dim, dtype=dtype),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, self.weight_loader, self.loaded_shape)

    def loaded_shape(self, param: Tensor, shard_id: ShardId | None = None) -> torch.Size:
        check_no_shard_id(shard_id)
        return torch.Size((self.num_embeddings, *param.shape[1:]))

    def weight_loader(
        self, param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None
    ) -> None:
        check_loaded_shape(param, loaded_weight, self.loaded_shape(param, shard_id), shard_id)
        load_narrowed(param.data, loaded_weight, 0, self.tp_rank, self.tp_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        """``input_ids`` [num_tokens] (values in ``[0, vocab)``) → ``[num_tokens, hidden]``."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        is_local = (local_ids >= 0) & (local_ids < self.local_num_embeddings)
        embedded = F.embedding(local_ids * is_local, self.weight) * is_local.unsqueeze(-1)
        return self.tp_group.all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over a vocabulary-parallel table; logits are gathered to full vocab."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``[num_tokens, hidden]`` → float32 logits ``[num_tokens, vocab]`` on every rank."""
        logits = F.linear(hidden_states, self.weight)
        return self.tp_group.all_gather(logits, dim=-1).float()
