"""Per-step attention metadata, installed for the duration of one forward pass.

``with forward_context(meta): model(input_ids, positions)`` makes ``meta`` visible to every
attention layer through ``get_attention_metadata()``. The scope is non-reentrant: entering it
while already inside one raises ``ForwardContextError``. The current value lives in a
``ContextVar``, so threads and tasks never see each other's metadata.

Token layout (flat over the batch; sequence s owns tokens
``query_start_loc[s] : query_start_loc[s + 1]``):

| quantity                  | range / meaning                                              |
|---------------------------|--------------------------------------------------------------|
| query_len[s]              | ``query_start_loc[s+1] - query_start_loc[s]``, ``>= 1``      |
| cached prefix of s        | positions ``[0, seq_lens[s] - query_len[s])``, already in KV  |
| new token i of s          | position ``seq_lens[s] - query_len[s] + i``                  |
| block_tables[s, j]        | block holding positions ``[j * block_size, (j+1) * block_size)`` |
| entries j >= ceil(seq_lens[s] / block_size) | padding: never read                        |

Decode is the case ``max_query_len == 1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor


class ForwardContextError(RuntimeError):
    """Attention metadata was requested outside a forward context, or a context was nested."""


@dataclass(frozen=True)
class AttentionMetadata:
    """What the attention layers need for one step (see the module docstring for layout).

    Construction checks dtypes and ranks only (no device synchronisation).
    """

    slot_mapping: Tensor  # int64 [num_tokens]: block_id * block_size + offset per new token
    block_tables: Tensor  # int32 [num_seqs, max_num_blocks_per_seq]; rows padded
    seq_lens: Tensor  # int32 [num_seqs]: context length after this step (cached + new)
    query_start_loc: Tensor  # int32 [num_seqs + 1]: cumulative new-token counts
    max_query_len: int
    max_seq_len: int

    def __post_init__(self) -> None:
        expected = {
            "slot_mapping": (torch.int64, 1),
            "block_tables": (torch.int32, 2),
            "seq_lens": (torch.int32, 1),
            "query_start_loc": (torch.int32, 1),
        }
        for name, (dtype, ndim) in expected.items():
            tensor: Tensor = getattr(self, name)
            if tensor.dtype != dtype or tensor.dim() != ndim:
                raise ValueError(
                    f"AttentionMetadata.{name} must be a {ndim}-d {dtype} tensor, "
                    f"got {tensor.dim()}-d {tensor.dtype}"
                )
        num_seqs = self.seq_lens.shape[0]
        if self.query_start_loc.shape[0] != num_seqs + 1 or self.block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"inconsistent batch: {num_seqs} seq_lens, {self.block_tables.shape[0]} "
                f"block table rows, {self.query_start_loc.shape[0]} query_start_loc entries "
                "(expected num_seqs, num_seqs and num_seqs + 1)"
            )
        if not 1 <= self.max_query_len <= self.max_seq_len:
            raise ValueError(
                f"need 1 <= max_query_len <= max_seq_len, got {self.max_query_len} and "
                f"{self.max_seq_len}"
            )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


_current: ContextVar[AttentionMetadata | None] = ContextVar("attention_metadata", default=None)


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Installs ``meta`` for the scope. Raises ``ForwardContextError`` if already inside one."""
    if _current.get() is not None:
        raise ForwardContextError(
            "forward_context is not reentrant: a forward pass is already in progress in this "
            "thread; finish it before starting another"
        )
    token = _current.set(meta)
    try:
        yield
    finally:
        _current.reset(token)


def get_attention_metadata() -> AttentionMetadata:
    """Returns the metadata of the current forward pass; raises outside ``forward_context``."""
    meta = _current.get()
    if meta is None:
        raise ForwardContextError(
            "no attention metadata: run the model inside `with forward_context(meta):`"
        )
    return meta
