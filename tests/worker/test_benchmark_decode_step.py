"""The benchmarks' synthetic decode step (``benchmarks/decode.py``) addresses only blocks the KV
cache has: with a table as long as ``max_model_len`` per sequence, batch 512 addressed 131,072
blocks of a 44,000-block cache, an illegal address on the H200 (run of 2026-12-02)."""

from __future__ import annotations

import pytest

from benchmarks.decode import decode_step
from dormant import SamplingParams


def test_each_sequence_gets_the_blocks_its_context_needs_within_the_cache() -> None:
    step = decode_step(512, 768, 16, num_kv_blocks=44213)
    tables = [seq.block_table for seq in step.seqs]
    assert all(len(table) == 49 for table in tables)  # 769 positions in blocks of 16
    blocks = [block for table in tables for block in table]
    assert len(set(blocks)) == len(blocks) and max(blocks) < 44213
    assert all(seq.start_position == 768 for seq in step.seqs)


def test_a_step_that_does_not_fit_the_cache_raises() -> None:
    with pytest.raises(ValueError, match="need 25088 KV blocks"):
        decode_step(512, 768, 16, num_kv_blocks=25087)


def test_a_multi_step_call_gets_the_blocks_of_its_later_positions_and_its_params() -> None:
    params = SamplingParams(temperature=1.0, logprobs=0)
    step = decode_step(4, 767, 16, num_kv_blocks=1000, params=params, num_steps=4)
    # positions 767 .. 770: 771 positions in blocks of 16
    assert all(len(seq.block_table) == 49 and seq.params is params for seq in step.seqs)


def test_the_moe_step_fits_the_cache_and_routes_each_sequence_differently() -> None:
    """Regression: benchmarks/moe.py passed the cache's block count where moe_roofline's step
    took blocks per sequence, so every table was the whole cache (an index past the input
    buffers' width on the H200, 2026-12-02c run 5)."""
    from benchmarks.moe_roofline import decode_step as moe_decode_step

    step = moe_decode_step(64, 512, 16, num_kv_blocks=5000)
    assert all(len(seq.block_table) == 33 for seq in step.seqs)  # 513 positions in blocks of 16
    assert len({seq.token_ids for seq in step.seqs}) == 64
    with pytest.raises(ValueError, match="KV blocks"):
        moe_decode_step(64, 512, 16, num_kv_blocks=2000)
