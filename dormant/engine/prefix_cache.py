"""Automatic prefix caching (vLLM's ``enable_prefix_caching``): full KV blocks found again by
the tokens they hold.

A block is *full* when all ``block_size`` of its positions hold tokens of a sequence. Its hash
chains the hash of the block before it with its own token ids (SHA-256), so block ``j`` of two
sequences hashes the same exactly when their first ``(j + 1) * block_size`` tokens are equal.
A sequence *publishes* a full block when the step that computes the block's last position is
scheduled; a sequence prefilled later whose leading blocks hash the same *hits* them: it holds
them too and computes only what follows, also in the step that computes them (every layer
writes the step's keys and values before any row attends, so a row may read blocks another row
of the step computes). The ``n`` samples of a request do better: samples ``1 .. n-1`` fork from
sample 0 (``engine/forks.py``) and compute none of the prompt; where they cannot fork, they hit
its blocks as any sequence does.

Sharing is read-only. A hit never covers the block of a sequence's last token (it must compute
that token to sample), so nobody writes a position of a hashed block again.

    block state     holders   hashed   kept in
    ──────────────  ───────   ──────   ──────────────────────────────────────────────
    free            0         no       the block manager's free list
    held            >= 1      maybe    its holders' block tables
    cached, free    0         yes      ``PrefixCache`` (LRU: the oldest is evicted first)

THE INVARIANT (DESIGN §3 invariant 10): every hashed block holds the KV of the tokens of its
hash, computed with the weights in use now. Nothing the user does is needed to keep it; the
engine drops every hash (``reset``) whenever that could stop being true:

    event                                              who sees it          resets
    ─────────────────────────────────────────────────  ───────────────────  ──────────────────
    a weight is written, by any path (update_weights,  the worker's         before the next
    load_weights on the model object, reload_weights,  RefitRecord counts   schedule, once a
    IPC, a weight-update group) or a refit fails       it; every rank       rank's count moved
                                                       reports the count    (LLMEngine)
    KV backing memory is discarded (a sleep at any     the worker counts    the same
    level, a release of kv_cache)                      it the same way
    a worker extension or callable runs                the engine           after the call
    a step fails (its published blocks were never      the scheduler        at once
    computed)
    reset_prefix_cache()                               the engine           at once

A reset also stops every running sequence from publishing more blocks (``epoch``): the KV it
computes afterwards attends to a prefix computed before the reset.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from dormant.engine.sequence import Sequence


def chain_hash(parent: bytes, token_ids: array[int]) -> bytes:
    """The hash of a block holding ``token_ids`` after the blocks hashed ``parent`` (b"" for
    the first block)."""
    return hashlib.sha256(parent + token_ids.tobytes()).digest()


def extend_block_hashes(seq: Sequence, num_blocks: int, block_size: int) -> list[bytes]:
    """``seq.block_hashes``, extended to its first ``num_blocks`` full blocks (computed once
    each, as the sequence grows). Precondition: those blocks are full of tokens."""
    hashes = seq.block_hashes
    for index in range(len(hashes), num_blocks):
        tokens = array("q", seq.token_ids_between(index * block_size, (index + 1) * block_size))
        hashes.append(chain_hash(hashes[-1] if hashes else b"", tokens))
    return hashes


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """What the prefix cache did since the engine started (``memory_status()``, ``/metrics``).

    ``num_query_tokens`` are the tokens of every sequence looked up when it was prefilled
    (again, after a preemption) and ``num_hit_tokens`` those found cached; ``num_cached_blocks``
    are the blocks hashed now (held or free), ``num_evictable_blocks`` those of them no
    sequence holds. ``num_resets`` counts invalidations, by the engine or the user.
    """

    is_enabled: bool
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_cached_blocks: int = 0
    num_evictable_blocks: int = 0
    num_evictions: int = 0
    num_resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PrefixCache:
    """The hashes of published blocks, and the LRU of the hashed blocks no sequence holds.

    Invariants: ``_block_by_hash`` and ``_hash_by_block`` are inverse maps; every evictable
    block is hashed. Which blocks are held is the block manager's to know.
    """

    def __init__(self) -> None:
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.epoch = 0  # bumped by every reset; a sequence publishes only in its own epoch
        self._num_query_tokens = self._num_hit_tokens = 0
        self._num_evictions = self._num_resets = 0

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def is_hashed(self, block_id: int) -> bool:
        return block_id in self._hash_by_block

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the leading ``hashes`` that are cached, up to the first miss."""
        blocks: list[int] = []
        for block_hash in hashes:
            block_id = self._block_by_hash.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self._num_query_tokens += num_query_tokens
        self._num_hit_tokens += num_hit_tokens

    def publish(self, block_id: int, block_hash: bytes) -> None:
        """Hashes ``block_id`` unless an equal block is cached already (then it stays
        unhashed, a private copy) or the block is hashed already."""
        if block_hash not in self._block_by_hash and block_id not in self._hash_by_block:
            self._block_by_hash[block_hash] = block_id
            self._hash_by_block[block_id] = block_hash

    def take(self, block_id: int) -> None:
        """A hit holds an evictable block again: it is no longer evictable."""
        del self._evictable[block_id]

    def release(self, block_id: int) -> bool:
        """``block_id`` lost its last holder: keeps it as the newest evictable block if it is
        hashed (returns True); else the caller frees it (False)."""
        if block_id not in self._hash_by_block:
            return False
        self._evictable[block_id] = None
        return True

    def evict(self) -> int | None:
        """Drops the hash of the least recently freed cached block; returns it (None if no
        block is evictable)."""
        if not self._evictable:
            return None
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_by_hash[self._hash_by_block.pop(block_id)]
        self._num_evictions += 1
        return block_id

    def reset(self) -> list[int]:
        """Drops every hash and starts a new epoch; returns the formerly evictable blocks,
        which the caller frees. Held blocks stay held, unhashed."""
        freed = list(self._evictable)
        self._evictable.clear()
        self._block_by_hash.clear()
        self._hash_by_block.clear()
        self.epoch += 1
        self._num_resets += 1
        return freed

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            is_enabled=True,
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_cached_blocks=len(self._hash_by_block),
            num_evictable_blocks=len(self._evictable),
            num_evictions=self._num_evictions,
            num_resets=self._num_resets,
        )
