"""The prefix cache in the block manager and the scheduler: hashing, hits, read-only sharing,
LRU eviction, reset and epochs, and its statistics."""

from __future__ import annotations

import random

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.core.sleep_state import RankSleepState
from dormant.engine.batch import SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.prefix_cache import PrefixCache
from dormant.engine.scheduler import Scheduler
from dormant.engine.sequence import Sequence, SequenceFactory
from dormant.engine.sleep_control import SleepControl
from dormant.memory import TagState
from tests.engine.scheduler_helpers import postprocess

BLOCK = 4


def make_seq(seq_id: int, tokens: list[int], **params: object) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(**params), seed=0)  # type: ignore[arg-type]


def prefill(manager: BlockManager, seq: Sequence) -> list[int]:
    """Allocates ``seq`` with its hits, publishes it as computed; returns the hits."""
    cached = manager.cached_blocks(seq)
    manager.allocate(seq, None, cached)
    manager.publish(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return cached


def test_a_prompt_is_found_again_up_to_the_block_of_its_last_token() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    a = make_seq(0, list(range(1, 13)))  # 12 tokens: 3 full blocks
    assert prefill(manager, a) == []
    b = make_seq(1, list(range(1, 13)))
    hits = manager.cached_blocks(b)
    assert hits == a.block_table[:2]  # block 2 holds b's last token: b computes it itself
    manager.allocate(b, None, hits)
    assert [manager.num_holders(x) for x in a.block_table] == [2, 2, 1]
    assert b.block_table[2] != a.block_table[2] and b.num_cached_tokens == 8
    manager.check_invariant([a, b])


def test_equal_tokens_after_a_different_prefix_do_not_hit() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    prefill(manager, make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert manager.cached_blocks(make_seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    hits = manager.cached_blocks(make_seq(2, [1, 2, 3, 4, 0, 6, 7, 8, 9]))
    assert len(hits) == 1  # the first block only


def test_without_prefix_caching_nothing_is_shared() -> None:
    manager = BlockManager(16, BLOCK)
    prefill(manager, make_seq(0, list(range(1, 13))))
    assert manager.cached_blocks(make_seq(1, list(range(1, 13)))) == []
    assert not manager.prefix_cache_stats().is_enabled


def test_a_first_prefill_with_prompt_logprobs_reads_no_cache() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    prefill(manager, make_seq(0, list(range(1, 13))))
    assert manager.cached_blocks(make_seq(1, list(range(1, 13)), prompt_logprobs=1)) == []


def test_freed_cached_blocks_are_evicted_oldest_first_tails_before_prefixes() -> None:
    manager = BlockManager(6, BLOCK, enable_prefix_caching=True)
    a = make_seq(0, list(range(1, 14)))  # 13 tokens: 3 full blocks, 4 blocks
    prefill(manager, a)
    a_blocks = list(a.block_table)
    manager.free(a)  # the 3 full blocks stay cached; the partial one is free
    assert manager.num_free_blocks == 6 and manager.prefix_cache_stats().num_evictable_blocks == 3
    b = make_seq(1, [50 + i for i in range(12)])  # needs 3 blocks: 3 free, then 0 evictions
    prefill(manager, b)
    assert manager.prefix_cache_stats().num_evictions == 0
    c = make_seq(2, [90, 91, 92, 93, 94])  # needs 2: evicts a's last full block, then its 2nd
    prefill(manager, c)
    assert manager.prefix_cache_stats().num_evictions == 2
    assert c.block_table == [a_blocks[2], a_blocks[1]]
    again = make_seq(3, list(range(1, 14)))
    assert manager.cached_blocks(again) == a_blocks[:1]  # a's first block outlived its tail
    manager.check_invariant([b, c])


def test_hits_on_evictable_blocks_are_counted_when_checking_for_room() -> None:
    manager = BlockManager(3, BLOCK, enable_prefix_caching=True)
    a = make_seq(0, list(range(1, 10)))  # 9 tokens: 2 full blocks + 1
    prefill(manager, a)
    manager.free(a)
    b = make_seq(1, list(range(1, 10)))  # hits both full blocks, needs one more: fits
    hits = manager.cached_blocks(b)
    assert len(hits) == 2 and manager.can_allocate(b, None, hits)
    longer = make_seq(2, list(range(1, 14)))  # hits 2, needs 2 more, only 1 left
    assert not manager.can_allocate(longer, None, manager.cached_blocks(longer))
    manager.allocate(b, None, hits)
    manager.check_invariant([b])


def test_reset_frees_cached_blocks_and_stops_running_sequences_publishing() -> None:
    manager = BlockManager(8, BLOCK, enable_prefix_caching=True)
    a, b = make_seq(0, list(range(1, 10))), make_seq(1, [7] * 9)
    prefill(manager, a)
    prefill(manager, b)
    manager.free(b)
    manager.reset_prefix_cache()
    stats = manager.prefix_cache_stats()
    assert (stats.num_cached_blocks, stats.num_evictable_blocks, stats.num_resets) == (0, 0, 1)
    assert manager.num_free_blocks == 8 - len(a.block_table)
    for token in (5, 5, 5, 5):  # a decodes on into a new full block: KV over an old prefix
        a.append_token(token)
        manager.append_block_if_needed(a)
        manager.publish(a, a.num_tokens)
    assert manager.prefix_cache_stats().num_cached_blocks == 0
    manager.free(a)
    assert manager.num_free_blocks == 8
    manager.check_invariant([a, b])


def test_statistics_count_looked_up_and_hit_tokens() -> None:
    manager = BlockManager(16, BLOCK, enable_prefix_caching=True)
    prefill(manager, make_seq(0, list(range(1, 13))))
    prefill(manager, make_seq(1, list(range(1, 13))))
    stats = manager.prefix_cache_stats()
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (24, 8)
    assert stats.hit_rate == pytest.approx(8 / 24) and stats.num_cached_blocks == 3


def test_publishing_an_equal_block_twice_keeps_the_first() -> None:
    cache = PrefixCache()
    cache.publish(3, b"h")
    cache.publish(5, b"h")
    assert cache.lookup([b"h"]) == [3] and not cache.is_hashed(5)


def test_invariant_holds_under_random_operations_with_prefix_caching() -> None:
    rng = random.Random(0)
    manager = BlockManager(24, 3, enable_prefix_caching=True)
    prompts = [[rng.randrange(4) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    seqs: list[Sequence] = []
    for step in range(600):
        action = rng.randrange(4)
        if action == 0 and len([s for s in seqs if s.block_table]) < 6:
            seq = make_seq(step, rng.choice(prompts))
            hits = manager.cached_blocks(seq)
            if manager.can_allocate(seq, None, hits):
                prefill(manager, seq)
                seqs.append(seq)
        elif action == 1 and seqs:
            seq = rng.choice(seqs)
            if seq.block_table:
                seq.append_token(rng.randrange(4))
                if manager.can_append(seq):
                    manager.append_block_if_needed(seq)
                    manager.publish(seq, seq.num_tokens)
                else:
                    manager.free(seq)
        elif action == 2 and seqs:
            manager.free(rng.choice(seqs))
        elif rng.random() < 0.05:
            manager.reset_prefix_cache()
        manager.check_invariant(seqs)
        held = {b for s in seqs for b in s.block_table}
        assert len(held) + manager.num_free_blocks == manager.num_blocks


def test_the_n_samples_of_a_prompt_hit_its_blocks_in_the_same_step() -> None:
    config = SchedulerConfig(8, 64, 64, enable_chunked_prefill=True)
    scheduler = Scheduler(config, BlockManager(32, BLOCK, True), frozenset({0}))
    factory = SequenceFactory()
    params = SamplingParams(n=3, max_tokens=2)
    seqs = [factory.create(list(range(1, 18)), params, i) for i in range(3)]  # 4 full blocks
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch is not None and batch.num_new_tokens == (17, 1, 1)
    assert seqs[1].block_table[:4] == seqs[0].block_table[:4]
    assert [seq.num_cached_tokens for seq in seqs] == [0, 16, 16]
    postprocess(scheduler, batch, [5, 6, 7])
    assert [seq.output_token_ids for seq in seqs] == [[5], [6], [7]]
    scheduler.block_manager.check_invariant(seqs)


def test_a_preempted_sequence_recomputes_only_what_the_cache_lost() -> None:
    config = SchedulerConfig(4, 64, 64)
    scheduler = Scheduler(config, BlockManager(32, BLOCK, True), frozenset({0}))
    seq = SequenceFactory().create(list(range(1, 11)), SamplingParams(max_tokens=8))
    scheduler.add(seq)
    postprocess(scheduler, scheduler.schedule(), [9])  # type: ignore[arg-type]
    scheduler.preempt_all()  # between steps: the KV is still valid
    batch = scheduler.schedule()
    assert batch is not None and batch.num_new_tokens == (3,)  # 11 tokens, 2 blocks cached


def test_sleep_state_counts_are_not_compared_across_ranks() -> None:
    """Ranks may write their shards in different numbers of calls; they still agree."""
    tags = (("weights", TagState.AWAKE), ("kv_cache", TagState.AWAKE))
    ranks = [RankSleepState(tags, frozenset(), 3, 1, 0), RankSleepState(tags, frozenset(), 3, 5, 2)]
    assert SleepControl(ranks).kv_epoch == ((1, 0), (5, 2))
