"""BlockManager: allocation, growth, freeing, slots and the ownership invariant."""

from __future__ import annotations

import random

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.block_manager import (
    AlreadyAllocatedError,
    BlockManager,
    BlockManagerError,
    BlockOwnershipError,
    OutOfBlocksError,
)
from dormant.engine.sequence import Sequence


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, range(1, num_tokens + 1), SamplingParams(), seed=0)


def test_starts_all_free() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    assert manager.num_free_blocks == 4
    assert manager.num_used_blocks == 0
    manager.check_invariant([])


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_covers_all_tokens(num_tokens: int, num_blocks: int) -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, num_tokens)
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    assert len(seq.block_table) == num_blocks
    assert manager.num_free_blocks == 8 - num_blocks
    manager.check_invariant([seq])


def test_cannot_allocate_beyond_free_blocks() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(0, 9)
    assert not manager.can_allocate(seq)
    with pytest.raises(OutOfBlocksError, match="needs 3 more blocks but only 2"):
        manager.allocate(seq)
    assert seq.block_table == []
    assert manager.num_free_blocks == 2


def test_allocating_twice_raises() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, 3)
    manager.allocate(seq)
    with pytest.raises(AlreadyAllocatedError):
        manager.allocate(seq)


def test_append_needs_a_block_only_after_the_last_one_filled() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(0, 4)
    manager.allocate(seq)
    assert len(seq.block_table) == 1
    # Token 5 (position 4) starts a new block.
    seq.append_token(9)
    assert manager.can_append(seq)
    manager.append_block_if_needed(seq)
    assert len(seq.block_table) == 2
    # Positions 5..7 fit in the second block.
    for _ in range(3):
        seq.append_token(9)
        assert manager.can_append(seq)
        manager.append_block_if_needed(seq)
        assert len(seq.block_table) == 2
    seq.append_token(9)
    assert not manager.can_append(seq)
    with pytest.raises(OutOfBlocksError):
        manager.append_block_if_needed(seq)
    assert len(seq.block_table) == 2
    manager.check_invariant([seq])


def test_append_to_unallocated_sequence_raises() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(BlockOwnershipError, match="allocate it first"):
        manager.append_block_if_needed(make_seq(0, 1))


def test_free_returns_blocks_and_is_idempotent() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq(0, 5)
    manager.allocate(seq)
    manager.free(seq)
    assert seq.block_table == []
    assert manager.num_free_blocks == 4
    manager.free(seq)
    assert manager.num_free_blocks == 4
    manager.check_invariant([seq])


def test_free_rejects_foreign_blocks() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    owner, thief = make_seq(0, 2), make_seq(1, 2)
    manager.allocate(owner)
    thief.block_table.append(owner.block_table[0])
    with pytest.raises(BlockOwnershipError, match="did not give it"):
        manager.free(thief)
    assert manager.num_free_blocks == 3


def test_check_invariant_detects_a_shared_block() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq(0, 2), make_seq(1, 2)
    manager.allocate(a)
    b.block_table.append(a.block_table[0])
    with pytest.raises(BlockManagerError, match="is in"):
        manager.check_invariant([a, b])


def test_check_invariant_detects_a_lost_block() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate(make_seq(0, 3))
    with pytest.raises(BlockManagerError, match="neither free nor"):
        manager.check_invariant([])


def test_invariant_holds_under_random_operations() -> None:
    rng = random.Random(0)
    manager = BlockManager(num_blocks=16, block_size=3)
    seqs = [make_seq(i, rng.randint(1, 10)) for i in range(8)]
    for _ in range(500):
        seq = rng.choice(seqs)
        action = rng.randrange(3)
        if action == 0 and not seq.block_table and manager.can_allocate(seq):
            manager.allocate(seq)
        elif action == 1 and seq.block_table:
            seq.append_token(0)
            if manager.can_append(seq):
                manager.append_block_if_needed(seq)
            else:
                manager.free(seq)
        elif action == 2:
            manager.free(seq)
        manager.check_invariant(seqs)
        held = sum(len(s.block_table) for s in seqs)
        assert held + manager.num_free_blocks == manager.num_blocks
        for s in seqs:
            if s.block_table:
                assert len(s.block_table) == manager.num_blocks_for(s.num_tokens)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_invalid_sizes_raise(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
