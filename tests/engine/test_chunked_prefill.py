"""Chunked prefill mixed with decodes (vLLM V1's scheduling): the token budget, decodes that
never wait behind a long prompt, first-come-first-served order, and preemption (by recompute)
with chunks in flight."""

from __future__ import annotations

import random

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.batch import ScheduledBatch, SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import RequestTooLongError, Scheduler
from dormant.engine.sequence import FinishReason, Sequence, SequenceFactory, SequenceStatus

EOS = 0


def make_scheduler(
    budget: int = 16,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    prefix_caching: bool = False,
    num_decode_steps: int = 1,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs, budget, max_model_len, num_decode_steps=num_decode_steps,
        max_multi_step_seqs=8, enable_chunked_prefill=True,
    )  # fmt: skip
    return Scheduler(config, BlockManager(num_blocks, 4, prefix_caching), frozenset({EOS}))


def add(scheduler: Scheduler, factory: SequenceFactory, num_tokens: int, **params) -> Sequence:
    params.setdefault("max_tokens", 8)
    tokens = [(7 * i + factory_offset(factory)) % 97 + 1 for i in range(num_tokens)]
    seq = factory.create(tokens, SamplingParams(**params))
    scheduler.add(seq)
    return seq


def factory_offset(factory: SequenceFactory) -> int:
    return id(factory) % 13  # distinct prompts per test, equal within one


def step(scheduler: Scheduler, token_id: int = 5) -> tuple[ScheduledBatch, list[Sequence]]:
    batch = scheduler.schedule()
    assert batch is not None
    assert batch.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        covered = len(seq.block_table) * scheduler.block_manager.block_size
        assert seq.status is SequenceStatus.RUNNING and num_new >= 1
        assert covered >= seq.num_computed_tokens + num_new
    tokens = [[token_id] * batch.num_steps for _ in batch.seqs]
    return batch, scheduler.postprocess_steps(batch, tokens)


def rows(batch: ScheduledBatch) -> dict[int, int]:
    return {seq.seq_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}


def test_a_long_prompt_is_computed_in_chunks_of_the_budget() -> None:
    scheduler, factory = make_scheduler(budget=16), SequenceFactory()
    seq = add(scheduler, factory, 40)
    for expected in (16, 16):
        batch, _ = step(scheduler)
        assert rows(batch) == {seq.seq_id: expected} and batch.is_prefill
        assert seq.num_output_tokens == 0  # a chunk samples nothing
    batch, _ = step(scheduler)
    assert rows(batch) == {seq.seq_id: 8}
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 40
    batch, _ = step(scheduler)
    assert not batch.is_prefill and rows(batch) == {seq.seq_id: 1}


def test_decodes_run_every_step_while_a_long_prompt_is_chunked() -> None:
    scheduler, factory = make_scheduler(budget=16), SequenceFactory()
    decoding = [add(scheduler, factory, 3, max_tokens=20) for _ in range(3)]
    step(scheduler)  # their prefill
    long = add(scheduler, factory, 60)
    for _ in range(4):
        before = [seq.num_output_tokens for seq in decoding]
        batch, _ = step(scheduler)
        assert rows(batch) == {**{s.seq_id: 1 for s in decoding}, long.seq_id: 13}
        assert batch.is_prefill and batch.num_prefill_tokens == 13
        assert [seq.num_output_tokens for seq in decoding] == [b + 1 for b in before]
    batch, _ = step(scheduler)
    assert rows(batch)[long.seq_id] == 8 and long.num_output_tokens == 1


def test_waiting_prompts_are_served_in_order_with_the_budget_left() -> None:
    scheduler, factory = make_scheduler(budget=16), SequenceFactory()
    first, second, third = (add(scheduler, factory, 20) for _ in range(3))
    batch, _ = step(scheduler)
    assert rows(batch) == {first.seq_id: 16}
    batch, _ = step(scheduler)  # the running chunk first, then the next prompt
    assert rows(batch) == {first.seq_id: 4, second.seq_id: 12}
    batch, _ = step(scheduler)
    assert rows(batch) == {first.seq_id: 1, second.seq_id: 8, third.seq_id: 7}


def test_preemption_with_a_chunk_in_flight_recomputes_it() -> None:
    """8 blocks of 4. A decoding sequence holds 4; a 24-token prompt's first chunk takes the
    other 4. Its next chunk finds no block: it is the newest, so it preempts itself. Started
    again, its chunk takes the free blocks again, and when the decode needs a 5th block the
    chunk in flight (the tail) is preempted for it. It finishes once the decode is done."""
    scheduler, factory = make_scheduler(budget=16, num_blocks=8), SequenceFactory()
    a = add(scheduler, factory, 13, max_tokens=5)
    step(scheduler)  # 14 tokens, 4 blocks
    long = add(scheduler, factory, 24, max_tokens=1)
    batch, _ = step(scheduler)
    assert rows(batch) == {a.seq_id: 1, long.seq_id: 15}
    assert scheduler.block_manager.num_free_blocks == 0
    batch, _ = step(scheduler)  # long needs 2 more blocks: it preempts itself
    assert rows(batch) == {a.seq_id: 1} and long.status is SequenceStatus.WAITING
    assert long.num_computed_tokens == 0 and long.block_table == []
    batch, _ = step(scheduler)  # recomputed from the start
    assert rows(batch) == {a.seq_id: 1, long.seq_id: 15}
    batch, _ = step(scheduler)  # a's position 16 needs a 5th block: the chunk in flight goes
    assert rows(batch) == {a.seq_id: 1} and long.status is SequenceStatus.WAITING
    scheduler.block_manager.check_invariant([a, long])
    while scheduler.has_unfinished:
        step(scheduler)
        scheduler.block_manager.check_invariant([a, long])
    assert long.finish_reason is FinishReason.LENGTH and long.num_output_tokens == 1
    assert a.num_output_tokens == 5


def test_prompt_logprobs_are_never_chunked() -> None:
    scheduler, factory = make_scheduler(budget=16), SequenceFactory()
    running = add(scheduler, factory, 10)
    step(scheduler)  # 11 tokens: 1 decode token per step from now on
    whole = add(scheduler, factory, 16, prompt_logprobs=1)
    batch, _ = step(scheduler)  # 15 tokens left in the budget: it waits, whole
    assert rows(batch) == {running.seq_id: 1}
    scheduler.abort([running.seq_id])
    batch, _ = step(scheduler)
    assert rows(batch) == {whole.seq_id: 16}
    with pytest.raises(RequestTooLongError, match="prompt logprobs"):
        add(scheduler, factory, 17, prompt_logprobs=0)


def test_several_decode_steps_only_when_no_prompt_is_in_flight() -> None:
    scheduler, factory = make_scheduler(budget=16, num_decode_steps=4), SequenceFactory()
    a = add(scheduler, factory, 3, temperature=0.0, max_tokens=30)
    step(scheduler)
    batch, _ = step(scheduler)
    assert batch.num_steps == 4
    add(scheduler, factory, 40, temperature=0.0)
    for _ in range(3):  # chunks of the prompt: single steps, mixed
        batch, _ = step(scheduler)
        assert batch.num_steps == 1 and a in batch.seqs
    batch, _ = step(scheduler)
    assert batch.num_steps == 4 and not batch.is_prefill


def test_the_budget_may_be_smaller_than_max_model_len_only_when_chunking() -> None:
    SchedulerConfig(4, 8, 128, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(4, 8, 128)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_workload_with_chunks_runs_to_completion(prefix_caching: bool) -> None:
    rng = random.Random(1)
    scheduler = make_scheduler(
        budget=12, num_blocks=16, max_num_seqs=5, max_model_len=40, prefix_caching=prefix_caching
    )
    factory = SequenceFactory(rng)
    shared = [rng.randrange(1, 9) for _ in range(30)]
    seqs: list[Sequence] = []
    for _ in range(3000):
        if len(seqs) < 50 and rng.random() < 0.3:
            num_prompt = rng.randint(1, 30)
            seq = factory.create(
                shared[:num_prompt], SamplingParams(max_tokens=rng.randint(1, 40 - num_prompt))
            )
            scheduler.add(seq)
            seqs.append(seq)
        if rng.random() < 0.02:
            scheduler.preempt_all()
        batch = scheduler.schedule()
        if batch is None:
            if len(seqs) >= 50:
                break
            continue
        assert batch.num_seqs <= 5 and batch.num_scheduled_tokens <= 12
        tokens = [[EOS if rng.random() < 0.03 else 3] for _ in batch.seqs]
        scheduler.postprocess_steps(batch, tokens)
        scheduler.block_manager.check_invariant(seqs)
    else:
        pytest.fail("the workload did not drain in 3000 steps")
    assert all(seq.is_finished for seq in seqs)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
