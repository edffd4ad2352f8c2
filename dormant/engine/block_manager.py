"""Hands out KV-cache blocks to sequences, reference-counted so that the ``n`` samples of a
request share their prompt's full blocks (no prefix caching across requests).

A sequence's KV for token position ``p`` lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``; its flat slot in the cache is ``block_id * block_size + offset``.

Sharing is read-only: a sequence may share only blocks that are full of prompt positions
before its last prompt token, which nobody writes again. The block holding the last prompt
token is never shared: each sample computes (recomputes, for all but the first) that partial
block into its own block, so no copy-on-write, and no worker command, is needed.

Invariant (checked by ``check_invariant``): every block id in ``0 .. num_blocks-1`` is
either in the free list or held, listed once in the ``block_table`` of each of its holders.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from dormant.engine.sequence import Sequence
from dormant.errors import EngineError


class BlockManagerError(EngineError):
    """Base class for misuse of the block manager."""


class OutOfBlocksError(BlockManagerError):
    """Not enough free blocks; check ``can_allocate`` / ``can_append`` first."""


class AlreadyAllocatedError(BlockManagerError):
    """``allocate`` was called for a sequence that already holds blocks."""


class BlockOwnershipError(BlockManagerError):
    """A block table names blocks this manager did not give to that sequence."""


class BlockManager:
    """A free list of KV block ids and the bookkeeping of who holds which block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._holders_by_block_id: dict[int, set[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def num_shareable_blocks(self, seq: Sequence) -> int:
        """How many leading blocks ``seq`` may share with another sample of its prompt: the
        full ones before the block of its last prompt token."""
        return (seq.num_prompt_tokens - 1) // self.block_size

    def can_allocate(self, seq: Sequence, num_shared_blocks: int = 0) -> bool:
        """Whether ``allocate(seq, ..., num_shared_blocks)`` would succeed on block count."""
        needed = self.num_blocks_for(seq.num_tokens) - num_shared_blocks
        return needed <= len(self._free_block_ids)

    def allocate(
        self, seq: Sequence, share_from: Sequence | None = None, num_shared_blocks: int = 0
    ) -> None:
        """Give ``seq`` blocks for all of its ``num_tokens`` tokens: the first
        ``num_shared_blocks`` of ``share_from``'s table (one more holder each), then new ones.

        Preconditions: ``seq.block_table`` is empty (else ``AlreadyAllocatedError``),
        ``share_from`` holds that many blocks and ``num_shared_blocks`` is at most
        ``num_shareable_blocks(seq)`` (else ``BlockOwnershipError``), and
        ``can_allocate(seq, num_shared_blocks)`` (else ``OutOfBlocksError``). A failed call
        changes nothing. Postcondition: ``len(seq.block_table) == num_blocks_for(seq.num_tokens)``.
        """
        if seq.block_table:
            raise AlreadyAllocatedError(
                f"{seq!r} already holds blocks {seq.block_table}; free it before allocating"
            )
        shared: list[int] = []
        if num_shared_blocks:
            if share_from is None or len(share_from.block_table) < num_shared_blocks:
                raise BlockOwnershipError(f"{share_from!r} has no {num_shared_blocks} blocks")
            if num_shared_blocks > self.num_shareable_blocks(seq):
                raise BlockOwnershipError(
                    f"{seq!r} may share at most {self.num_shareable_blocks(seq)} blocks"
                )
            shared = share_from.block_table[:num_shared_blocks]
        needed = self.num_blocks_for(seq.num_tokens) - len(shared)
        if needed > len(self._free_block_ids):
            raise OutOfBlocksError(
                f"{seq!r} needs {needed} more blocks but only "
                f"{len(self._free_block_ids)} of {self.num_blocks} are free"
            )
        for block_id in shared:
            self._holders_by_block_id[block_id].add(seq.seq_id)
        seq.block_table.extend(shared)
        self._take_blocks(seq, needed)

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        """Whether the table of ``seq`` can grow to cover ``num_tokens + num_lookahead``
        tokens.

        Called before a decode step, after the previous step appended one token whose KV
        the step will write: a new block is needed only when the earlier tokens filled
        the last block exactly. A multi-step decode writes ``num_lookahead`` more.
        """
        return self.num_missing_blocks(seq, num_lookahead) <= len(self._free_block_ids)

    def append_block_if_needed(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Grow the table of an allocated ``seq`` to cover ``num_tokens + num_lookahead``
        tokens.

        Preconditions: ``seq`` holds blocks (else ``BlockOwnershipError``) and
        ``can_append(seq, num_lookahead)`` (else ``OutOfBlocksError``; nothing changes).
        Postcondition: ``len(seq.block_table) >= num_blocks_for(seq.num_tokens +
        num_lookahead)``.
        """
        if not seq.block_table:
            raise BlockOwnershipError(f"{seq!r} holds no blocks; allocate it first")
        self._take_blocks(seq, self.num_missing_blocks(seq, num_lookahead))

    def num_missing_blocks(self, seq: Sequence, num_lookahead: int = 0) -> int:
        """Blocks ``seq`` lacks to cover ``num_tokens + num_lookahead`` tokens."""
        needed = self.num_blocks_for(seq.num_tokens + num_lookahead)
        return max(0, needed - len(seq.block_table))

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and clear its table; a block returns to the free
        list when its last holder released it.

        A sequence without blocks is left as is. Raises ``BlockOwnershipError`` (changing
        nothing) if the table names a block that is not held by ``seq``.
        """
        holders = self._holders_by_block_id
        foreign = [b for b in seq.block_table if seq.seq_id not in holders.get(b, ())]
        if foreign:
            raise BlockOwnershipError(
                f"{seq!r} lists blocks {foreign} that this manager did not give it"
            )
        for block_id in seq.block_table:
            holders[block_id].discard(seq.seq_id)
            if not holders[block_id]:
                del holders[block_id]
                self._free_block_ids.append(block_id)
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat KV-cache slot of token ``position`` of ``seq``.

        Raises ``IndexError`` if the position is not covered by the sequence's table.
        """
        block_index, offset = divmod(position, self.block_size)
        if position < 0 or block_index >= len(seq.block_table):
            raise IndexError(
                f"position {position} is outside the {len(seq.block_table)} blocks of {seq!r}"
            )
        return seq.block_table[block_index] * self.block_size + offset

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The slots of positions ``start .. end-1`` of ``seq``, built block by block."""
        if start < 0 or end > len(seq.block_table) * self.block_size:
            raise IndexError(f"positions {start}..{end - 1} are outside the blocks of {seq!r}")
        result: list[int] = []
        position = start
        while position < end:
            block_index, offset = divmod(position, self.block_size)
            num_in_block = min(self.block_size - offset, end - position)
            first = seq.block_table[block_index] * self.block_size + offset
            result.extend(range(first, first + num_in_block))
            position += num_in_block
        return result

    def num_holders(self, block_id: int) -> int:
        """How many sequences hold ``block_id`` (0 when it is free)."""
        return len(self._holders_by_block_id.get(block_id, ()))

    def check_invariant(self, seqs: Iterable[Sequence]) -> None:
        """Raise ``BlockManagerError`` unless every block is free or held, and each held block
        is listed once in the table of each of its holders and of no other sequence.

        ``seqs`` must be every sequence that may hold blocks (for tests and debugging).
        """
        free = set(self._free_block_ids)
        if len(free) != len(self._free_block_ids):
            raise BlockManagerError("the free list holds a block twice")
        listed: dict[int, set[int]] = {}
        holders = self._holders_by_block_id
        for seq in seqs:
            if len(set(seq.block_table)) != len(seq.block_table):
                raise BlockManagerError(f"{seq!r} lists a block twice: {seq.block_table}")
            for block_id in seq.block_table:
                if block_id in free:
                    raise BlockManagerError(f"block {block_id} is free and in {seq!r}")
                if seq.seq_id not in holders.get(block_id, ()):
                    raise BlockManagerError(
                        f"block {block_id} is in {seq!r} but not recorded as held by it"
                    )
                listed.setdefault(block_id, set()).add(seq.seq_id)
        missing = sorted(set(range(self.num_blocks)) - free - listed.keys())
        if missing:
            raise BlockManagerError(f"blocks {missing} are neither free nor in any given table")
        if listed != holders:
            raise BlockManagerError(
                f"the tables list holders {listed} but the recorded ones are {holders}"
            )

    def _take_blocks(self, seq: Sequence, num_blocks: int) -> None:
        if num_blocks > len(self._free_block_ids):
            raise OutOfBlocksError(
                f"{seq!r} needs {num_blocks} more blocks but only "
                f"{len(self._free_block_ids)} of {self.num_blocks} are free"
            )
        for _ in range(num_blocks):
            block_id = self._free_block_ids.popleft()
            self._holders_by_block_id[block_id] = {seq.seq_id}
            seq.block_table.append(block_id)
