"""Scheduling fused multi-step decodes: when a batch runs several steps at once (greedy and
sampled requests alike), the blocks it takes ahead, and how its tokens are applied."""

from __future__ import annotations

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.batch import SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import Scheduler
from dormant.engine.sequence import FinishReason, Sequence, SequenceFactory
from tests.engine.scheduler_helpers import postprocess

EOS = 0
FILLER = 7
STEPS = 4


def make_scheduler(
    num_blocks: int = 64, max_model_len: int = 64, max_seqs: int = 8, max_num_seqs: int = 8
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs, 64, max_model_len, num_decode_steps=STEPS, max_multi_step_seqs=max_seqs
    )
    return Scheduler(config, BlockManager(num_blocks, 4), frozenset({EOS}))


def add(scheduler: Scheduler, factory: SequenceFactory, num_tokens: int, **params) -> Sequence:
    params.setdefault("temperature", 0.0)
    seq = factory.create([FILLER] * num_tokens, SamplingParams(**params))
    scheduler.add(seq)
    return seq


def prefill(scheduler: Scheduler) -> None:
    batch = scheduler.schedule()
    assert batch is not None and batch.is_prefill and batch.num_steps == 1
    postprocess(scheduler, batch, [FILLER] * batch.num_seqs)


def test_greedy_decode_runs_several_steps_with_blocks_for_all_of_them() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    seqs = [add(scheduler, factory, 4, max_tokens=20), add(scheduler, factory, 6, max_tokens=20)]
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None and not batch.is_prefill
    assert batch.num_steps == STEPS and batch.num_scheduled_tokens == 2 * STEPS
    for seq in seqs:  # positions num_tokens - 1 .. num_tokens + STEPS - 2 have slots
        assert len(seq.block_table) * 4 >= seq.num_tokens + STEPS - 1
    scheduler.postprocess_steps(batch, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert seqs[0].output_token_ids[-STEPS:] == [1, 2, 3, 4]
    assert seqs[1].output_token_ids[-STEPS:] == [5, 6, 7, 8]
    assert all(seq.num_computed_tokens == seq.num_tokens - 1 for seq in seqs)
    scheduler.block_manager.check_invariant(seqs)


def test_a_sequence_stopping_mid_batch_drops_the_later_tokens() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    stopping, going = add(scheduler, factory, 4, max_tokens=20), add(scheduler, factory, 4)
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None and batch.num_steps == STEPS
    finished = scheduler.postprocess_steps(batch, [[3, EOS, 5, 6], [9, 9, 9, 9]])
    assert finished == [stopping] and stopping.finish_reason is FinishReason.STOP
    assert stopping.output_token_ids[-2:] == [3, EOS] and stopping.block_table == []
    assert going.output_token_ids[-STEPS:] == [9, 9, 9, 9]


def test_sampled_decodes_run_several_steps_beside_greedy_ones() -> None:
    """Random requests, filtered or not, penalised or not, with or without a seed: the worker
    samples each step as a single step would (its fused graph, or single steps for the rows
    the graph does not fit), so the scheduler no longer asks for greedy ones."""
    scheduler, factory = make_scheduler(), SequenceFactory()
    seqs = [
        add(scheduler, factory, 4, temperature=1.0, seed=1, max_tokens=20),
        add(scheduler, factory, 5, temperature=0.8, max_tokens=20),
        add(scheduler, factory, 6, max_tokens=20),
        add(scheduler, factory, 3, temperature=1.0, top_p=0.9, presence_penalty=0.5),
    ]
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None and not batch.is_prefill
    assert batch.num_steps == STEPS and batch.num_scheduled_tokens == len(seqs) * STEPS
    for seq in seqs:
        assert len(seq.block_table) * 4 >= seq.num_tokens + STEPS - 1
    scheduler.postprocess_steps(batch, [[1, 2, 3, 4]] * len(seqs))
    assert all(seq.output_token_ids[-STEPS:] == [1, 2, 3, 4] for seq in seqs)
    scheduler.block_manager.check_invariant(seqs)


def test_a_sampled_sequence_stopping_mid_batch_drops_the_later_tokens() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    stopping = add(scheduler, factory, 4, temperature=1.0, seed=3, max_tokens=20)
    going = add(scheduler, factory, 4, temperature=1.0, seed=4)
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None and batch.num_steps == STEPS
    finished = scheduler.postprocess_steps(batch, [[3, 5, EOS, 6], [9, 9, 9, 9]])
    assert finished == [stopping] and stopping.finish_reason is FinishReason.STOP
    assert stopping.output_token_ids[-3:] == [3, 5, EOS] and stopping.block_table == []
    assert going.output_token_ids[-STEPS:] == [9, 9, 9, 9]
    batch = scheduler.schedule()  # the one left runs on, still several steps at once
    assert batch is not None and batch.seqs == (going,) and batch.num_steps == STEPS


@pytest.mark.parametrize(
    "case", ["few tokens left", "near max_model_len", "waiting", "too many seqs"]
)
def test_one_step_when_several_would_not_be_right(case: str) -> None:
    scheduler = make_scheduler(
        max_model_len=6 if case == "near max_model_len" else 64,
        max_seqs=1 if case == "too many seqs" else 8,
        max_num_seqs=1 if case == "waiting" else 8,
    )
    factory = SequenceFactory()
    add(scheduler, factory, 4, temperature=1.0, max_tokens=3 if case == "few tokens left" else 16)
    if case == "too many seqs":
        add(scheduler, factory, 4, max_tokens=16)
    prefill(scheduler)
    if case == "waiting":
        add(scheduler, factory, 4)  # cannot be prefilled while the first one runs
    batch = scheduler.schedule()
    assert batch is not None and not batch.is_prefill
    assert batch.num_steps == 1


def test_one_step_when_the_lookahead_blocks_are_not_free() -> None:
    scheduler, factory = make_scheduler(num_blocks=4), SequenceFactory()
    seqs = [add(scheduler, factory, 7, max_tokens=4), add(scheduler, factory, 3, max_tokens=4)]
    prefill(scheduler)  # 8 and 4 tokens: 3 blocks held, 1 free; 4 steps would need 2 more
    batch = scheduler.schedule()
    assert batch is not None and batch.num_steps == 1
    assert [len(seq.block_table) for seq in seqs] == [2, 1]


def test_postprocess_steps_checks_the_shape() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    add(scheduler, factory, 4)
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None and batch.num_steps == STEPS
    with pytest.raises(ValueError, match=r"\[1\] steps, for a batch of 1 sequences of 4 steps"):
        postprocess(scheduler, batch, [FILLER])
    scheduler.postprocess_steps(batch, [[FILLER] * STEPS])  # nothing changed: still in flight
