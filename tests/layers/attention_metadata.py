"""Attention metadata for layer tests: derived from per-sequence lengths on the host (the engine
fills preallocated buffers instead, in ``worker/input_buffers.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from dormant.layers.context import AttentionMetadata


def build_attention_metadata(
    block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, block_size: int
) -> AttentionMetadata:
    """Derives ``slot_mapping`` and ``query_start_loc`` from per-sequence lengths.

    It synchronises with the host (it reads the token count and the maxima).
    Preconditions: ``1 <= query_lens <= seq_lens <= block_tables.shape[1] * block_size``.
    """
    device = block_tables.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    query_lens = query_lens.to(device=device, dtype=torch.int32)
    capacity = block_tables.shape[1] * block_size
    if bool((query_lens < 1).any() | (query_lens > seq_lens).any() | (seq_lens > capacity).any()):
        raise ValueError(
            f"need 1 <= query_lens <= seq_lens <= {capacity} (block table capacity); got "
            f"query_lens={query_lens.tolist()}, seq_lens={seq_lens.tolist()}"
        )
    query_start_loc = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    num_tokens = int(query_start_loc[-1])
    seq_ids = torch.arange(seq_lens.shape[0], device=device)
    token_seq = torch.repeat_interleave(seq_ids, query_lens.long(), output_size=num_tokens)
    token_index = torch.arange(num_tokens, device=device) - query_start_loc[token_seq]
    positions = (seq_lens - query_lens)[token_seq].long() + token_index
    blocks = block_tables[token_seq, positions // block_size].long()
    return AttentionMetadata(
        slot_mapping=blocks * block_size + positions % block_size,
        block_tables=block_tables.to(torch.int32),
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
