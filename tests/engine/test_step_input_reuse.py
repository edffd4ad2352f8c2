"""The per-step host shortcuts give what the long way gives: the block-table tuple a sequence
reuses between steps (``Sequence.block_table_tuple``), and the block manager's batch growth
(``BlockManager.grow_all``)."""

from __future__ import annotations

import pytest

from dormant import SamplingParams
from dormant.engine.batch import ScheduledBatch
from dormant.engine.block_manager import BlockManager
from dormant.engine.sequence import Sequence


def _seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, range(3, 3 + num_tokens), SamplingParams(), seed=seq_id)


def _sent_table(seq: Sequence) -> tuple[int, ...]:
    """The block table ``step_input`` sends for a decode of ``seq``."""
    seq.num_computed_tokens = seq.num_tokens - 1
    return ScheduledBatch.of([(seq, 1)]).step_input(frozenset()).seqs[0].block_table


def test_the_sent_table_follows_growth() -> None:
    manager, seq = BlockManager(num_blocks=8, block_size=4), _seq(0, 4)
    manager.allocate(seq)
    assert _sent_table(seq) == tuple(seq.block_table) == (0,)
    assert _sent_table(seq) is _sent_table(seq)  # unchanged: the same tuple, not a new one
    seq.append_token(9)
    manager.append_block_if_needed(seq)
    assert _sent_table(seq) == tuple(seq.block_table) == (0, 1)


def test_a_freed_and_refilled_table_of_the_same_length_is_sent_anew() -> None:
    manager, seq = BlockManager(num_blocks=8, block_size=4), _seq(0, 4)
    manager.allocate(seq)
    assert _sent_table(seq) == (0,)
    manager.free(seq)  # preempted; block 0 goes to the back of the free list
    manager.allocate(seq)  # recomputed: as many blocks as before, other ids
    assert seq.block_table == [1]
    assert _sent_table(seq) == (1,)


@pytest.mark.parametrize("lookahead", [0, 3, 5])
def test_grow_all_takes_the_blocks_grow_takes_one_by_one(lookahead: int) -> None:
    """With ``num_lookahead`` (a multi-step decode's extra positions) as well."""
    batch, single = BlockManager(24, 4), BlockManager(24, 4)
    seqs = {m: [_seq(i, 4 + 3 * i) for i in range(4)] for m in ("batch", "single")}
    for manager, group in ((batch, seqs["batch"]), (single, seqs["single"])):
        for seq in group:
            manager.allocate(seq)
            seq.append_token(7)
    assert batch.grow_all(seqs["batch"], lookahead)
    for seq in seqs["single"]:
        single.append_block_if_needed(seq, lookahead)
    assert [s.block_table for s in seqs["batch"]] == [s.block_table for s in seqs["single"]]
    assert batch.num_free_blocks == single.num_free_blocks
    batch.check_invariant(seqs["batch"])


def test_grow_all_changes_nothing_when_the_blocks_run_short() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    seqs = [_seq(0, 4), _seq(1, 8)]
    for seq in seqs:
        manager.allocate(seq)
        seq.append_token(7)  # each now needs one more block; one is free
    tables = [list(s.block_table) for s in seqs]
    assert not manager.grow_all(seqs)
    assert [s.block_table for s in seqs] == tables
    assert manager.num_free_blocks == 1  # the first would fit alone: nothing was taken
    assert not manager.grow_all(seqs[:1], 5)  # two more blocks with the lookahead
    assert [s.block_table for s in seqs] == tables and manager.num_free_blocks == 1
