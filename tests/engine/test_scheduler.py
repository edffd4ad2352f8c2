"""Scheduler: continuous batching, finishing, preemption, abort and preempt_all."""

from __future__ import annotations

import random

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.batch import ScheduledBatch, SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import (
    DuplicateSequenceError,
    RequestTooLongError,
    Scheduler,
    SchedulerError,
)
from dormant.engine.sequence import FinishReason, Sequence, SequenceFactory, SequenceStatus
from tests.engine.scheduler_helpers import postprocess

EOS = 0
FILLER = 7  # a token that never stops anything


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    return Scheduler(config, BlockManager(num_blocks, block_size), frozenset({EOS}))


def add(
    scheduler: Scheduler, factory: SequenceFactory, num_prompt_tokens: int, **kwargs: object
) -> Sequence:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    seq = factory.create([FILLER] * num_prompt_tokens, params)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, token_id: int = FILLER) -> tuple[ScheduledBatch, list[Sequence]]:
    batch = scheduler.schedule()
    assert batch is not None
    for seq in batch.seqs:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * scheduler.block_manager.block_size >= seq.num_tokens
    return batch, postprocess(scheduler, batch, [token_id] * batch.num_seqs)


def all_seqs_hold_consistent_blocks(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    scheduler.block_manager.check_invariant(seqs)
    for seq in seqs:
        if seq.status is not SequenceStatus.RUNNING:
            assert seq.block_table == []


def test_empty_scheduler_schedules_nothing() -> None:
    scheduler = make_scheduler()
    assert scheduler.schedule() is None
    assert not scheduler.has_unfinished


def test_prefill_then_decode() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    a = add(scheduler, factory, 5)
    b = add(scheduler, factory, 3)
    assert (scheduler.num_waiting, scheduler.num_running) == (2, 0)

    batch, finished = step(scheduler)
    assert batch.is_prefill and batch.seqs == (a, b) and finished == []
    assert (a.num_computed_tokens, a.num_tokens) == (5, 6)
    assert (scheduler.num_waiting, scheduler.num_running) == (0, 2)

    batch = scheduler.schedule()
    assert batch is not None and not batch.is_prefill and batch.seqs == (a, b)
    assert batch.num_scheduled_tokens == 2
    postprocess(scheduler, batch, [FILLER, FILLER])
    assert (a.num_computed_tokens, a.num_tokens) == (6, 7)


def test_prefill_computes_from_num_computed_tokens() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    add(scheduler, factory, 5)
    batch = scheduler.schedule()
    assert batch is not None
    assert batch.num_scheduled_tokens == 5


def test_waiting_sequences_are_prefilled_before_decodes() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    a = add(scheduler, factory, 2)
    step(scheduler)
    b = add(scheduler, factory, 2)
    batch, _ = step(scheduler)
    assert batch.is_prefill and batch.seqs == (b,)
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.seqs == (a, b)


def test_prefill_respects_token_budget() -> None:
    scheduler, factory = (
        make_scheduler(max_num_batched_tokens=10, max_model_len=10),
        (SequenceFactory()),
    )
    seqs = [add(scheduler, factory, 4) for _ in range(3)]
    batch, _ = step(scheduler)
    assert batch.seqs == tuple(seqs[:2])
    batch, _ = step(scheduler)
    assert batch.is_prefill and batch.seqs == (seqs[2],)


def test_running_sequences_are_capped_by_max_num_seqs() -> None:
    scheduler, factory = make_scheduler(max_num_seqs=2), SequenceFactory()
    seqs = [add(scheduler, factory, 1) for _ in range(3)]
    batch, _ = step(scheduler)
    assert batch.seqs == tuple(seqs[:2])
    batch, _ = step(scheduler)
    assert not batch.is_prefill and batch.num_seqs == 2
    assert scheduler.num_waiting == 1


def test_prefill_waits_for_free_blocks() -> None:
    scheduler, factory = (
        make_scheduler(num_blocks=3, block_size=4, max_model_len=12),
        (SequenceFactory()),
    )
    a = add(scheduler, factory, 8, max_tokens=2)
    b = add(scheduler, factory, 8, max_tokens=2)
    batch, _ = step(scheduler)
    assert batch.seqs == (a,)
    _, finished = step(scheduler)
    assert finished == [a] and a.finish_reason is FinishReason.LENGTH
    batch, _ = step(scheduler)
    assert batch.is_prefill and batch.seqs == (b,)


def test_eos_finishes_with_stop_and_frees_blocks() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    seq = add(scheduler, factory, 3)
    _, finished = step(scheduler, token_id=EOS)
    assert finished == [seq]
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids == [EOS]
    assert seq.block_table == []
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert not scheduler.has_unfinished
    assert scheduler.schedule() is None


def test_ignore_eos_keeps_generating() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    seq = add(scheduler, factory, 3, ignore_eos=True, max_tokens=3)
    finished: list[Sequence] = []
    while not finished:
        _, finished = step(scheduler, token_id=EOS)
    assert seq.output_token_ids == [EOS] * 3
    assert seq.finish_reason is FinishReason.LENGTH


def test_stop_token_ids_finish_with_stop() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    seq = add(scheduler, factory, 3, stop_token_ids=[5], ignore_eos=True)
    step(scheduler, token_id=FILLER)
    _, finished = step(scheduler, token_id=5)
    assert finished == [seq] and seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids == [FILLER, 5]


def test_max_tokens_finishes_with_length() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    seq = add(scheduler, factory, 3, max_tokens=4)
    num_steps = 0
    while scheduler.has_unfinished:
        step(scheduler)
        num_steps += 1
    assert num_steps == 4
    assert seq.num_output_tokens == 4 and seq.finish_reason is FinishReason.LENGTH


def test_max_model_len_finishes_with_length() -> None:
    scheduler, factory = make_scheduler(max_model_len=6), SequenceFactory()
    seq = add(scheduler, factory, 4, max_tokens=100)
    while scheduler.has_unfinished:
        step(scheduler)
    assert seq.num_tokens == 6 and seq.finish_reason is FinishReason.LENGTH


def test_prompt_of_exactly_max_model_len_gets_one_token() -> None:
    scheduler, factory = make_scheduler(max_model_len=8), SequenceFactory()
    seq = add(scheduler, factory, 8)
    _, finished = step(scheduler)
    assert finished == [seq] and seq.num_output_tokens == 1


def test_add_rejects_prompt_longer_than_max_model_len() -> None:
    scheduler, factory = make_scheduler(max_model_len=8), SequenceFactory()
    with pytest.raises(RequestTooLongError, match="max_model_len=8"):
        add(scheduler, factory, 9)
    assert not scheduler.has_unfinished


def test_add_rejects_request_that_can_never_fit_in_the_cache() -> None:
    scheduler, factory = make_scheduler(num_blocks=2, block_size=4), SequenceFactory()
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        add(scheduler, factory, 9, max_tokens=1)
    with pytest.raises(RequestTooLongError, match="lower max_tokens"):
        add(scheduler, factory, 4, max_tokens=6)  # needs KV for 9 tokens
    add(scheduler, factory, 4, max_tokens=5)  # needs KV for 8 tokens
    assert scheduler.num_waiting == 1


def test_add_rejects_duplicate_and_used_sequences() -> None:
    scheduler = make_scheduler()
    seq = Sequence(1, [FILLER], SamplingParams(), seed=0)
    scheduler.add(seq)
    with pytest.raises(DuplicateSequenceError):
        scheduler.add(Sequence(1, [FILLER], SamplingParams(), seed=0))
    step(scheduler)
    with pytest.raises(SchedulerError, match="WAITING"):
        make_scheduler().add(seq)


def test_decode_preempts_from_the_tail_when_blocks_run_out() -> None:
    # 4 blocks of 2: three 2-token prompts take 3 blocks; their third tokens need 3 more.
    scheduler, factory = (
        make_scheduler(num_blocks=4, block_size=2, max_model_len=8),
        (SequenceFactory()),
    )
    a, b, c = (add(scheduler, factory, 2) for _ in range(3))
    step(scheduler)  # prefill all three
    batch, _ = step(scheduler)
    # a takes the last free block; b needs one, so c (the tail) is preempted.
    assert not batch.is_prefill and batch.seqs == (a, b)
    assert c.status is SequenceStatus.WAITING
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert c.output_token_ids == [FILLER]  # outputs are kept
    assert scheduler.num_waiting == 1
    all_seqs_hold_consistent_blocks(scheduler, [a, b, c])


def test_preempted_sequence_recomputes_all_its_tokens() -> None:
    scheduler, factory = (
        make_scheduler(num_blocks=4, block_size=2, max_model_len=8),
        (SequenceFactory()),
    )
    a = add(scheduler, factory, 2, max_tokens=2)
    b = add(scheduler, factory, 2, max_tokens=2)
    c = add(scheduler, factory, 2, max_tokens=4)
    step(scheduler)
    step(scheduler)  # c is preempted; a and b finish
    assert a.is_finished and b.is_finished and c.status is SequenceStatus.WAITING
    batch = scheduler.schedule()
    assert batch is not None and batch.is_prefill and batch.seqs == (c,)
    assert batch.num_scheduled_tokens == 3  # prompt + the kept output token
    postprocess(scheduler, batch, [FILLER])
    while scheduler.has_unfinished:
        step(scheduler)
    assert c.num_output_tokens == 4


def test_abort_specific_sequences() -> None:
    scheduler, factory = make_scheduler(max_num_seqs=1), SequenceFactory()
    running = add(scheduler, factory, 2)
    waiting = add(scheduler, factory, 2)
    other = add(scheduler, factory, 2)
    step(scheduler)
    aborted = scheduler.abort([waiting.seq_id, running.seq_id, 12345])
    assert aborted == [waiting, running]
    assert all(s.finish_reason is FinishReason.ABORT for s in aborted)
    assert running.block_table == []
    assert (scheduler.num_waiting, scheduler.num_running) == (1, 0)
    assert scheduler.abort([running.seq_id]) == []  # already finished: ignored
    all_seqs_hold_consistent_blocks(scheduler, [running, waiting, other])


def test_abort_all() -> None:
    scheduler, factory = make_scheduler(max_num_seqs=1), SequenceFactory()
    seqs = [add(scheduler, factory, 2) for _ in range(3)]
    step(scheduler)
    assert sorted(s.seq_id for s in scheduler.abort()) == [s.seq_id for s in seqs]
    assert not scheduler.has_unfinished
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert scheduler.schedule() is None


def test_postprocess_skips_sequences_aborted_after_schedule() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    a = add(scheduler, factory, 2, max_tokens=1)
    b = add(scheduler, factory, 2, max_tokens=1)
    batch = scheduler.schedule()
    assert batch is not None
    scheduler.abort([a.seq_id])
    assert postprocess(scheduler, batch, [FILLER, FILLER]) == [b]
    assert a.output_token_ids == [] and a.finish_reason is FinishReason.ABORT


def test_postprocess_checks_token_count() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    add(scheduler, factory, 2)
    batch = scheduler.schedule()
    assert batch is not None
    with pytest.raises(ValueError, match=r"for 2 sequences .* batch of 1 sequences"):
        postprocess(scheduler, batch, [FILLER, FILLER])


def test_preempt_all_frees_every_block_and_resumes_in_order() -> None:
    scheduler, factory = make_scheduler(max_num_seqs=2), SequenceFactory()
    a, b, c = (add(scheduler, factory, 3, max_tokens=3) for _ in range(3))
    step(scheduler)
    step(scheduler)
    scheduler.preempt_all()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert (scheduler.num_waiting, scheduler.num_running) == (3, 0)
    for seq in (a, b):
        assert seq.status is SequenceStatus.WAITING
        assert seq.num_computed_tokens == 0 and seq.num_output_tokens == 2
    batch = scheduler.schedule()
    assert batch is not None and batch.is_prefill and batch.seqs == (a, b)
    assert batch.num_scheduled_tokens == 10
    postprocess(scheduler, batch, [FILLER, FILLER])
    while scheduler.has_unfinished:
        step(scheduler)
    assert [s.num_output_tokens for s in (a, b, c)] == [3, 3, 3]


def test_postprocess_after_preempt_all_raises() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    seq = add(scheduler, factory, 2)
    batch = scheduler.schedule()
    assert batch is not None
    scheduler.preempt_all()
    with pytest.raises(SchedulerError, match="discarded"):
        postprocess(scheduler, batch, [FILLER])
    assert seq.output_token_ids == []
    batch = scheduler.schedule()  # the discarded step is simply redone
    assert batch is not None and batch.seqs == (seq,) and batch.num_scheduled_tokens == 2


def test_one_batch_in_flight_at_a_time() -> None:
    scheduler, factory = make_scheduler(), SequenceFactory()
    seq = add(scheduler, factory, 2)
    batch = scheduler.schedule()
    assert batch is not None
    with pytest.raises(SchedulerError, match="still in flight"):
        scheduler.schedule()
    postprocess(scheduler, batch, [FILLER])
    with pytest.raises(SchedulerError, match="postprocessed already"):
        postprocess(scheduler, batch, [FILLER])
    assert seq.output_token_ids == [FILLER]


def test_random_workload_runs_to_completion() -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(
        num_blocks=12, block_size=4, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=24
    )
    factory = SequenceFactory(rng)
    seqs: list[Sequence] = []
    for _ in range(2000):
        if len(seqs) < 40 and rng.random() < 0.3:
            prompt_len = rng.randint(1, 12)
            max_tokens = rng.randint(1, 40 - prompt_len)
            seqs.append(add(scheduler, factory, prompt_len, max_tokens=max_tokens))
        if rng.random() < 0.02:
            scheduler.preempt_all()
        batch = scheduler.schedule()
        if batch is None:
            assert not scheduler.has_unfinished
            if len(seqs) >= 40:
                break
            continue
        assert batch.num_seqs <= 5 and batch.num_scheduled_tokens <= 24
        tokens = [EOS if rng.random() < 0.03 else FILLER for _ in batch.seqs]
        postprocess(scheduler, batch, tokens)
        all_seqs_hold_consistent_blocks(scheduler, seqs)
    else:
        pytest.fail("the workload did not drain in 2000 steps")
    for seq in seqs:
        assert seq.is_finished
        if seq.finish_reason is FinishReason.LENGTH:
            assert (
                seq.num_output_tokens == seq.params.max_tokens
                or seq.num_tokens == scheduler.config.max_model_len
            )
        else:
            assert seq.finish_reason is FinishReason.STOP and seq.last_token_id == EOS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 8, 8), "max_num_seqs"),
        ((1, 4, 8), "max_model_len"),
        ((16, 8, 8), "max_num_seqs"),
        ((1, 8, True), "max_model_len"),
    ],
)
def test_invalid_config_raises(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(*args)
