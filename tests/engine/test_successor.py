"""``Scheduler.schedule_successor``: the decode batch planned while the one before it is in flight
(async scheduling, ``engine/successor.py``): when it is planned, what its rows send the worker,
which rows it leaves out, and that it never preempts or changes anything when it cannot."""

from __future__ import annotations

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.batch import PLACEHOLDER_TOKEN_ID, ScheduledBatch, SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import Scheduler, SchedulerError
from dormant.engine.sequence import Sequence, SequenceFactory
from tests.engine.scheduler_helpers import postprocess

EOS, FILLER, BLOCK_SIZE = 0, 7, 4


def make(
    num_blocks: int = 64, num_decode_steps: int = 1, caching: bool = False, max_num_seqs: int = 8
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
        num_decode_steps=num_decode_steps, max_multi_step_seqs=8,
    )  # fmt: skip
    return Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE, caching), frozenset({EOS}))


def decoding(scheduler: Scheduler, *params: SamplingParams, prompt: int = 5) -> ScheduledBatch:
    """Adds one sequence per ``params``, prefills them, and returns their first decode batch
    (in flight)."""
    factory = SequenceFactory()
    for p in params:
        scheduler.add(factory.create([FILLER] * prompt, p))
    prefill = scheduler.schedule()
    assert prefill is not None and prefill.is_prefill
    postprocess(scheduler, prefill, [FILLER] * prefill.num_seqs)
    batch = scheduler.schedule()
    assert batch is not None and not batch.is_prefill
    return batch


def apply(scheduler: Scheduler, batch: ScheduledBatch, token_id: int = FILLER) -> list[Sequence]:
    return scheduler.postprocess_steps(batch, [[token_id] * batch.num_steps] * batch.num_seqs)


PLAIN = SamplingParams(temperature=0.0, max_tokens=20)


def test_a_successor_continues_every_row_from_the_tokens_in_flight() -> None:
    scheduler = make(num_decode_steps=4)
    batch = decoding(scheduler, PLAIN, PLAIN)
    assert batch.num_steps == 4
    successor = scheduler.schedule_successor(batch)
    assert successor is not None
    assert successor.seqs == batch.seqs and successor.previous_rows == (0, 1)
    assert (successor.lead, successor.num_steps) == (4, 4)
    step = successor.step_input(frozenset({EOS}))
    assert step.previous_rows == (0, 1) and not step.is_prefill
    for seq, row in zip(batch.seqs, step.seqs, strict=True):
        # 6 tokens now (5 + the prefill's); the batch in flight adds 4: the newest is at 9.
        assert (row.token_ids, row.start_position) == ((PLACEHOLDER_TOKEN_ID,), 9)
        assert row.num_output_tokens == 1 + 4
        assert len(seq.block_table) * BLOCK_SIZE >= 9 + 4  # its positions 9 .. 12
    with pytest.raises(SchedulerError):
        scheduler.schedule()  # two batches in flight: postprocess them first
    assert apply(scheduler, batch) == [] and apply(scheduler, successor) == []
    assert [seq.num_output_tokens for seq in batch.seqs] == [9, 9]
    assert all(seq.num_computed_tokens == seq.num_tokens - 1 for seq in batch.seqs)


def test_rows_that_leave_are_left_out_and_stopped_rows_skipped() -> None:
    scheduler = make()
    short = SamplingParams(temperature=0.0, max_tokens=2)  # its second token is in flight
    batch = decoding(scheduler, PLAIN, short, PLAIN, PLAIN)
    scheduler.abort([batch.seqs[2].seq_id])
    successor = scheduler.schedule_successor(batch)
    assert successor is not None and successor.previous_rows == (0, 3)
    # Row 0 stops on EOS in the batch in flight: its successor row's token is dropped.
    finished = scheduler.postprocess_steps(batch, [[EOS], [FILLER], [FILLER], [FILLER]])
    assert finished == [batch.seqs[0], batch.seqs[1]]
    assert apply(scheduler, successor) == []
    assert batch.seqs[0].output_token_ids == [FILLER, EOS]
    assert batch.seqs[3].num_output_tokens == 3


def test_a_full_batch_continues_while_others_wait_one_step_at_a_time() -> None:
    """Nothing that waits can start while every slot is taken: the successor runs (single
    steps, as the planner runs decodes with sequences waiting), unless a row's slot frees by
    length in the call in flight."""
    scheduler = make(num_decode_steps=4, max_num_seqs=2)
    batch = decoding(scheduler, PLAIN, PLAIN)
    scheduler.add(SequenceFactory(first_seq_id=100).create([FILLER] * 3, PLAIN))
    successor = scheduler.schedule_successor(batch)
    assert successor is not None and successor.num_steps == 1
    apply(scheduler, batch)
    apply(scheduler, successor)
    scheduler.abort([batch.seqs[1].seq_id])
    freed = scheduler.schedule()  # a slot is free: the waiting sequence is prefilled
    assert freed is not None and freed.is_prefill
    apply(scheduler, freed)

    scheduler = make(max_num_seqs=2)
    short = SamplingParams(temperature=0.0, max_tokens=2)  # finishes in the call in flight
    batch = decoding(scheduler, PLAIN, short)
    scheduler.add(SequenceFactory(first_seq_id=100).create([FILLER] * 3, PLAIN))
    assert scheduler.schedule_successor(batch) is None


@pytest.mark.parametrize(
    "why",
    ["waiting", "penalties", "no-blocks", "after-prefill", "only-one-in-flight"],
)
def test_no_successor_where_the_tokens_could_change_it(why: str) -> None:
    scheduler = make(num_blocks=6 if why == "no-blocks" else 64)
    params = SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=0.5)
    if why == "no-blocks":  # a request that fits the cache; its next block is taken below
        params = SamplingParams(temperature=0.0, max_tokens=10)
    batch = decoding(scheduler, params if why in ("penalties", "no-blocks") else PLAIN, prompt=7)
    if why == "waiting":
        scheduler.add(SequenceFactory(first_seq_id=100).create([FILLER] * 3, PLAIN))
    if why == "after-prefill":
        apply(scheduler, batch)
        scheduler.add(SequenceFactory(first_seq_id=100).create([FILLER] * 3, PLAIN))
        batch = scheduler.schedule()  # type: ignore[assignment]
        assert batch.is_prefill
    free_before = scheduler.block_manager.num_free_blocks
    tables = [list(seq.block_table) for seq in batch.seqs]
    if why == "only-one-in-flight":
        successor = scheduler.schedule_successor(batch)
        assert successor is not None
        with pytest.raises(SchedulerError):
            scheduler.schedule_successor(successor)
        return
    if why == "no-blocks":  # 7 + 1 tokens fill 2 of the 6 blocks; take the other four
        other = SequenceFactory(first_seq_id=200).create([FILLER] * 16, PLAIN)
        scheduler.block_manager.allocate(other, 16)
        free_before = scheduler.block_manager.num_free_blocks
    assert scheduler.schedule_successor(batch) is None
    assert scheduler.block_manager.num_free_blocks == free_before
    assert [list(seq.block_table) for seq in batch.seqs] == tables


def test_the_successors_rows_publish_their_blocks_once_their_tokens_are_known() -> None:
    scheduler = make(caching=True)
    batch = decoding(scheduler, PLAIN, prompt=7)  # 8 tokens: 2 full blocks
    (seq,) = batch.seqs
    successor = scheduler.schedule_successor(batch)
    assert successor is not None
    published = seq.num_published_blocks
    apply(scheduler, batch)  # 9 tokens known; the successor computes position 8's KV
    assert seq.num_published_blocks == published  # block 2 holds positions 8..11: not full
    apply(scheduler, successor)
    nxt = scheduler.schedule()
    assert nxt is not None
    apply(scheduler, nxt)
    again = scheduler.schedule()
    assert again is not None
    successor = scheduler.schedule_successor(again)
    assert successor is not None
    apply(scheduler, again)  # 12 tokens known: block 2 is full, computed by the successor
    assert seq.num_published_blocks == 3
