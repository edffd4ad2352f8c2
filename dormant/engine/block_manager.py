"""Hands out KV-cache blocks to sequences, reference-counted, and (with prefix caching) finds
full blocks again by the tokens they hold (``engine/prefix_cache.py``).

A sequence's KV for token position ``p`` lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``; its flat slot in the cache is ``block_id * block_size + offset``.

A block may be held by several sequences through a prefix-cache hit or a fork, and a shared
block is read-only: a hit covers whole blocks before the block of the sequence's last token, a
fork (``fork``) the leader's full prompt blocks, and nobody writes a position of those again.
The one copy-on-write is a fork's partial last block: the sibling gets a new block of its own,
which the workers fill from the leader's after the step's forward (``StepInput.block_copies``).

Invariant (checked by ``check_invariant``; the table is in ``block_invariant.py``): every block
id in ``0 .. num_blocks-1`` is exactly one of free, evictable (hashed, held by nobody) or held
(listed once in the ``block_table`` of each of its holders). Taking a block prefers the free
list, then evicts the least recently freed cached block. Its typed errors are in
``block_errors.py`` (importable from here too).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf

from dormant.engine.block_errors import (
    AlreadyAllocatedError,
    BlockManagerError,
    BlockOwnershipError,
    OutOfBlocksError,
)
from dormant.engine.block_invariant import invariant_violation
from dormant.engine.prefix_cache import PrefixCache, PrefixCacheStats, extend_block_hashes
from dormant.engine.sequence import Sequence


class BlockManager:
    """A free list of KV block ids, the bookkeeping of who holds which block, and the prefix
    cache (None when ``enable_prefix_caching`` is off: then no block is ever shared)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._holders_by_block_id: dict[int, set[int]] = {}
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: free ones, and cached ones nobody holds."""
        cache = self.prefix_cache
        return len(self._free_block_ids) + (cache.num_evictable if cache is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    # ── prefix caching ────────────────────────────────────────────────────────────────────────

    def cached_blocks(self, seq: Sequence) -> list[int]:
        """The leading blocks of ``seq`` found in the prefix cache: whole blocks before the one
        of its last token. Empty without prefix caching, and for a first prefill that returns
        prompt logprobs (they are computed at every prompt position). No state changes."""
        cache = self.prefix_cache
        if cache is None or (seq.params.prompt_logprobs is not None and not seq.output_token_ids):
            return []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        return cache.lookup(extend_block_hashes(seq, num_blocks, self.block_size)[:num_blocks])

    def publish(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Offers the cache the full blocks of ``seq`` whose positions all have KV once
        ``num_computed_tokens`` are computed (called when the step computing them is final).
        A sequence given its blocks before the cache's latest reset publishes nothing."""
        cache = self.prefix_cache
        if cache is None or seq.cache_epoch != cache.epoch:
            return
        num_full = min(num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_published_blocks:
            return
        hashes = extend_block_hashes(seq, num_full, self.block_size)
        for index in range(seq.num_published_blocks, num_full):
            cache.publish(seq.block_table[index], hashes[index])
        seq.num_published_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Drops every cached block (held ones stay held); running sequences publish nothing
        more. A no-op without prefix caching."""
        if self.prefix_cache is not None:
            self._free_block_ids.extend(self.prefix_cache.reset())

    def prefix_cache_stats(self) -> PrefixCacheStats:
        cache = self.prefix_cache
        return cache.stats() if cache is not None else PrefixCacheStats(is_enabled=False)

    # ── allocation ────────────────────────────────────────────────────────────────────────────

    def can_allocate(
        self, seq: Sequence, num_tokens: int | None = None, cached: SequenceOf[int] = ()
    ) -> bool:
        """Whether ``allocate(seq, num_tokens, cached)`` would succeed on block count."""
        cache = self.prefix_cache
        num_revived = sum(1 for b in cached if cache is not None and cache.is_evictable(b))
        needed = self.num_blocks_for(seq.num_tokens if num_tokens is None else num_tokens)
        return needed - len(cached) <= self.num_free_blocks - num_revived

    def allocate(
        self, seq: Sequence, num_tokens: int | None = None, cached: SequenceOf[int] = ()
    ) -> None:
        """Give ``seq`` blocks for its first ``num_tokens`` positions (default: all of its
        tokens): the ``cached`` blocks (``cached_blocks(seq)``; one more holder each), then new
        ones. Records the lookup in the cache's statistics and, for a first prefill, the hits
        in ``seq.num_cached_tokens``; the caller sets ``num_computed_tokens``.

        Preconditions: ``seq.block_table`` is empty (else ``AlreadyAllocatedError``) and
        ``can_allocate(seq, num_tokens, cached)`` (else ``OutOfBlocksError``). A failed call
        changes nothing. Postcondition: the table covers ``num_tokens`` positions.
        """
        if seq.block_table:
            raise AlreadyAllocatedError(
                f"{seq!r} already holds blocks {seq.block_table}; free it before allocating"
            )
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        if not self.can_allocate(seq, num_tokens, cached):
            raise OutOfBlocksError(
                f"{seq!r} needs {self.num_blocks_for(num_tokens) - len(cached)} more blocks "
                f"but only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        cache = self.prefix_cache
        for block_id in cached:
            assert cache is not None, "cached blocks without a prefix cache"
            if cache.is_evictable(block_id):
                cache.take(block_id)
                self._holders_by_block_id[block_id] = set()
            self._holders_by_block_id[block_id].add(seq.seq_id)
        seq.block_table.extend(cached)
        seq.num_published_blocks = len(cached)
        if cache is not None:
            seq.cache_epoch = cache.epoch
            cache.record_lookup(seq.num_tokens, len(cached) * self.block_size)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = len(cached) * self.block_size
        self._take_blocks(seq, self.num_blocks_for(num_tokens) - len(cached))

    def can_fork(self, num_tokens: int) -> bool:
        """Whether ``fork`` of a prompt of ``num_tokens`` has the block its copy needs."""
        return num_tokens % self.block_size == 0 or self.num_free_blocks >= 1

    def fork(self, leader: Sequence, sibling: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give ``sibling`` the KV of ``leader``'s first ``num_tokens`` positions (its prompt,
        computed in the step being planned): the full blocks shared (one more holder each), the
        partial last block, if any, as a new block of its own. Returns ``(source,
        destination)``, the copy the workers make after the step's forward, or None when
        ``num_tokens`` is a block multiple. The sibling counts the whole prompt as cached (in
        ``num_cached_tokens`` and the cache's statistics) and publishes only after it.

        Preconditions: ``sibling.block_table`` is empty (else ``AlreadyAllocatedError``), the
        leader's table covers ``num_tokens`` positions and ``can_fork(num_tokens)`` (else
        ``OutOfBlocksError``). A failed call changes nothing.
        """
        if sibling.block_table:
            raise AlreadyAllocatedError(
                f"{sibling!r} already holds blocks {sibling.block_table}; free it before forking"
            )
        num_full, partial = divmod(num_tokens, self.block_size)
        if len(leader.block_table) < num_full + bool(partial):
            raise BlockOwnershipError(f"{leader!r} holds no KV for {num_tokens} positions")
        if not self.can_fork(num_tokens):
            raise OutOfBlocksError(f"no free block for the copy of {leader!r}'s last block")
        for block_id in leader.block_table[:num_full]:
            self._holders_by_block_id[block_id].add(sibling.seq_id)
        sibling.block_table.extend(leader.block_table[:num_full])
        sibling.block_hashes = leader.block_hashes[:num_full]
        sibling.num_published_blocks = min(leader.num_published_blocks, num_full)
        sibling.cache_epoch = leader.cache_epoch
        if self.prefix_cache is not None:
            self.prefix_cache.record_lookup(num_tokens, num_tokens)
        if sibling.num_cached_tokens is None:
            sibling.num_cached_tokens = num_tokens
        if not partial:
            return None
        self._take_blocks(sibling, 1)
        return leader.block_table[num_full], sibling.block_table[-1]

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the table of ``seq`` can grow to cover ``num_tokens`` positions."""
        return self._num_missing(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the table of an allocated ``seq`` to cover ``num_tokens`` positions.

        Preconditions: ``seq`` holds blocks (else ``BlockOwnershipError``) and
        ``can_grow(seq, num_tokens)`` (else ``OutOfBlocksError``; nothing changes).
        """
        if not seq.block_table:
            raise BlockOwnershipError(f"{seq!r} holds no blocks; allocate it first")
        self._take_blocks(seq, self._num_missing(seq, num_tokens))

    def grow_all(self, seqs: SequenceOf[Sequence], num_lookahead: int = 0) -> bool:
        """``grow(seq, seq.num_tokens + num_lookahead)`` for each of ``seqs`` in turn (the same
        blocks), with one free-block count for all, when they all fit; else (or if one holds no
        blocks) returns False, changing nothing."""
        block_size, missing = self.block_size, []
        for seq in seqs:
            if not seq.block_table:
                return False
            num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids) + num_lookahead
            missing.append(-(-num_tokens // block_size) - len(seq.block_table))
        if sum(m for m in missing if m > 0) > self.num_free_blocks:
            return False
        for seq, num_missing in zip(seqs, missing, strict=True):
            if num_missing > 0:
                self._take_blocks(seq, num_missing)
        return True

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        """Whether the table of ``seq`` can grow to cover ``num_tokens + num_lookahead``
        tokens: before a decode step, whose token's KV goes at position ``num_tokens - 1``
        (a multi-step decode writes ``num_lookahead`` more)."""
        return self.can_grow(seq, seq.num_tokens + num_lookahead)

    def append_block_if_needed(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """``grow(seq, seq.num_tokens + num_lookahead)``."""
        self.grow(seq, seq.num_tokens + num_lookahead)

    def num_missing_blocks(self, seq: Sequence, num_lookahead: int = 0) -> int:
        """Blocks ``seq`` lacks to cover ``num_tokens + num_lookahead`` tokens."""
        return self._num_missing(seq, seq.num_tokens + num_lookahead)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and clear its table. A block nobody holds any more
        becomes evictable if it is cached (the sequence's last blocks the oldest, so a shared
        prefix outlives its tails), else free.

        A sequence without blocks is left as is. Raises ``BlockOwnershipError`` (changing
        nothing) if the table names a block that is not held by ``seq``.
        """
        holders = self._holders_by_block_id
        foreign = [b for b in seq.block_table if seq.seq_id not in holders.get(b, ())]
        if foreign:
            raise BlockOwnershipError(
                f"{seq!r} lists blocks {foreign} that this manager did not give it"
            )
        cache = self.prefix_cache
        for block_id in reversed(seq.block_table):
            holders[block_id].discard(seq.seq_id)
            if not holders[block_id]:
                del holders[block_id]
                if cache is None or not cache.release(block_id):
                    self._free_block_ids.append(block_id)
        seq.clear_block_table()
        seq.num_published_blocks = 0

    def num_holders(self, block_id: int) -> int:
        """How many sequences hold ``block_id`` (0 when it is free or evictable)."""
        return len(self._holders_by_block_id.get(block_id, ()))

    def check_invariant(self, seqs: Iterable[Sequence]) -> None:
        """Raise ``BlockManagerError`` unless every block is exactly one of free, evictable or
        held, and each held block is listed once in the table of each of its holders and of no
        other sequence (``block_invariant.py``). ``seqs`` must be every sequence that may hold
        blocks."""
        violation = invariant_violation(
            self.num_blocks,
            self._free_block_ids,
            self._holders_by_block_id,
            self.prefix_cache,
            seqs,
        )
        if violation is not None:
            raise BlockManagerError(violation)

    def _num_missing(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def _take_blocks(self, seq: Sequence, num_blocks: int) -> None:
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"{seq!r} needs {num_blocks} more blocks but only "
                f"{self.num_free_blocks} of {self.num_blocks} are free"
            )
        for _ in range(num_blocks):
            if self._free_block_ids:
                block_id = self._free_block_ids.popleft()
            else:
                assert self.prefix_cache is not None
                evicted = self.prefix_cache.evict()
                assert evicted is not None
                block_id = evicted
            self._holders_by_block_id[block_id] = {seq.seq_id}
            seq.block_table.append(block_id)
