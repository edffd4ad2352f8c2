"""The forward context and attention metadata."""

from __future__ import annotations

import pytest
import torch

from dormant.layers.context import (
    AttentionMetadata,
    ForwardContextError,
    forward_context,
    get_attention_metadata,
)
from tests.layers.attention_metadata import build_attention_metadata


def _meta() -> AttentionMetadata:
    tables = torch.tensor([[5, 2, 0], [1, 7, 3]], dtype=torch.int32)
    return build_attention_metadata(tables, torch.tensor([6, 9]), torch.tensor([3, 1]), 4)


def test_builder_derives_slots_and_offsets() -> None:
    meta = _meta()
    # seq 0: positions 3, 4, 5 -> blocks 5, 2, 2; seq 1: position 8 -> block 3 offset 0.
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 3 * 4 + 0]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 9)
    assert (meta.num_seqs, meta.num_tokens) == (2, 4)


def test_builder_rejects_inconsistent_lengths() -> None:
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="query_lens <= seq_lens"):
        build_attention_metadata(tables, torch.tensor([2]), torch.tensor([3]), 4)
    with pytest.raises(ValueError, match="capacity"):
        build_attention_metadata(tables, torch.tensor([9]), torch.tensor([1]), 4)


def test_metadata_validates_dtypes_and_batch() -> None:
    meta = _meta()
    with pytest.raises(ValueError, match=r"block_tables must be a 2-d torch\.int32"):
        AttentionMetadata(
            meta.slot_mapping,
            meta.block_tables.long(),
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_seq_len,
        )
    with pytest.raises(ValueError, match="inconsistent batch"):
        AttentionMetadata(
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc[:2],
            meta.max_query_len,
            meta.max_seq_len,
        )


def test_context_is_scoped_and_not_reentrant() -> None:
    meta = _meta()
    with pytest.raises(ForwardContextError, match="forward_context"):
        get_attention_metadata()
    with forward_context(meta):
        assert get_attention_metadata() is meta
        with pytest.raises(ForwardContextError, match="not reentrant"), forward_context(meta):
            pass
        assert get_attention_metadata() is meta
    with pytest.raises(RuntimeError, match="boom"), forward_context(meta):
        raise RuntimeError("boom")
    with pytest.raises(ForwardContextError):
        get_attention_metadata()
