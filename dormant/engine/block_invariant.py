"""The block manager's ownership invariant, checked from its bookkeeping (``BlockManager``
raises what this finds).

Every block id in ``0 .. num_blocks-1`` is exactly one of:

    state      in                                  holders recorded
    ─────────  ──────────────────────────────────  ─────────────────────────────────────────
    free       the free list (once)                none
    evictable  the prefix cache (hashed)           none
    held       the ``block_table`` of each holder  exactly the sequences whose tables list it
               (once per table)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from dormant.engine.prefix_cache import PrefixCache
from dormant.engine.sequence import Sequence


def invariant_violation(
    num_blocks: int,
    free_block_ids: Collection[int],
    holders_by_block_id: Mapping[int, set[int]],
    prefix_cache: PrefixCache | None,
    seqs: Iterable[Sequence],
) -> str | None:
    """What breaks the invariant (the first thing found, as a message), or None when it holds.

    ``seqs`` must be every sequence that may hold blocks. No state changes.
    """
    free = set(free_block_ids)
    if len(free) != len(free_block_ids):
        return "the free list holds a block twice"
    cache = prefix_cache
    evictable = {b for b in range(num_blocks) if cache is not None and cache.is_evictable(b)}
    if free & evictable:
        return f"blocks {sorted(free & evictable)} are free and evictable"
    if cache is not None and any(not cache.is_hashed(b) for b in evictable):
        return "an evictable block is not hashed"
    listed: dict[int, set[int]] = {}
    holders = holders_by_block_id
    for seq in seqs:
        if len(set(seq.block_table)) != len(seq.block_table):
            return f"{seq!r} lists a block twice: {seq.block_table}"
        for block_id in seq.block_table:
            if block_id in free or block_id in evictable:
                return f"block {block_id} is not held but is in {seq!r}"
            if seq.seq_id not in holders.get(block_id, ()):
                return f"block {block_id} is in {seq!r} but not recorded as held by it"
            listed.setdefault(block_id, set()).add(seq.seq_id)
    missing = sorted(set(range(num_blocks)) - free - evictable - listed.keys())
    if missing:
        return f"blocks {missing} are neither free nor in any given table"
    if listed != holders:
        return f"the tables list holders {listed} but the recorded ones are {holders}"
    return None
