"""One forward pass's attention metadata, built on the host (numpy) for speculative decoding's
passes (``spec_inputs.py``), then read from its device views.

Row ``r`` computes ``lengths[r]`` positions from ``starts[r]`` in blocks ``tables[r]``: its
positions, KV slots, sequence lengths after the pass, cumulative query starts and the block
table (flattened, ``width`` blocks per row) are five int64 arrays staged in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from dormant.layers.context import AttentionMetadata


@dataclass(frozen=True)
class PassLayout:
    """One forward pass's attention metadata on the host: row ``r`` computes ``lengths[r]``
    positions from ``starts[r]``, in blocks ``tables[r]``."""

    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    block_tables: np.ndarray  # [n * width]
    width: int
    max_query_len: int
    max_seq_len: int

    @classmethod
    def of(
        cls,
        starts: np.ndarray,
        lengths: np.ndarray,
        tables: SequenceOf[tuple[int, ...]],
        block_size: int,
    ) -> PassLayout:
        num_rows = len(tables)
        width = max(len(t) for t in tables)
        table = np.zeros((num_rows, width), np.int64)
        for row, row_blocks in enumerate(tables):
            table[row, : len(row_blocks)] = row_blocks
        cu = np.zeros(num_rows + 1, np.int64)
        np.cumsum(lengths, out=cu[1:])
        row_of = np.repeat(np.arange(num_rows), lengths)
        positions = starts[row_of] + np.arange(cu[-1]) - cu[:-1][row_of]
        blocks = table[row_of, positions // block_size]
        seq_lens = starts + lengths
        return cls(
            positions=positions,
            slot_mapping=blocks * block_size + positions % block_size,
            seq_lens=seq_lens,
            query_start_loc=cu,
            block_tables=table.reshape(-1),
            width=width,
            max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()),
        )

    def arrays(self) -> list[np.ndarray]:
        return [
            self.positions, self.slot_mapping, self.seq_lens, self.query_start_loc,
            self.block_tables,
        ]  # fmt: skip

    def metadata(self, views: SequenceOf[torch.Tensor]) -> tuple[torch.Tensor, AttentionMetadata]:
        """``(positions, metadata)`` from the device views of ``arrays()``."""
        positions, slots, seq_lens, query_start_loc, tables = views
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.view(-1, self.width).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=query_start_loc.to(torch.int32),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
        return positions, meta
