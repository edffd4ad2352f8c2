"""Scheduling with speculative decoding: which decode rows get drafts and how many, the blocks
they take, how their 1 .. j + 1 tokens are applied, and that drafts never preempt anyone."""

from __future__ import annotations

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.batch import SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import Scheduler
from dormant.engine.sequence import Sequence, SequenceFactory
from tests.engine.scheduler_helpers import postprocess

BLOCK = 4
K = 3


def make(num_blocks: int = 64, chunked: bool = True, max_model_len: int = 64) -> Scheduler:
    config = SchedulerConfig(8, 64, max_model_len, enable_chunked_prefill=chunked,
                             num_speculative_tokens=K)  # fmt: skip
    return Scheduler(config, BlockManager(num_blocks, BLOCK, True), frozenset({0}))


def add(scheduler: Scheduler, factory: SequenceFactory, n: int, **params: object) -> Sequence:
    fill = 7 + scheduler.num_waiting  # distinct prompts: no prefix-cache hits between them
    seq = factory.create([fill] * n, SamplingParams(temperature=0.0, **params))  # type: ignore[arg-type]
    scheduler.add(seq)
    return seq


def prefill(scheduler: Scheduler) -> None:
    batch = scheduler.schedule()
    assert batch is not None and batch.is_speculative and not any(batch.num_draft_tokens)
    draft_computed = [
        seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    ]
    scheduler.postprocess_steps(batch, [[5]] * batch.num_seqs, None, draft_computed)


@pytest.mark.parametrize("chunked", [True, False])
def test_decode_rows_get_drafts_within_their_limits(chunked: bool) -> None:
    scheduler, factory = make(chunked=chunked), SequenceFactory()
    plain = add(scheduler, factory, 5, max_tokens=20)
    near_end = add(scheduler, factory, 5, max_tokens=3)  # 1 after prefill: 2 left -> 1 draft
    penalised = add(scheduler, factory, 5, max_tokens=20, presence_penalty=0.5)
    held = add(scheduler, factory, 5, max_tokens=20, min_tokens=4)
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None
    assert list(batch.num_draft_tokens) == [K, 1, 0, 0]
    assert list(batch.num_new_tokens) == [1 + K, 2, 1, 1]
    for seq, j in zip((plain, near_end), (K, 1), strict=True):  # positions L-1 .. L-1+j covered
        assert len(seq.block_table) * BLOCK >= seq.num_tokens + j
    step = batch.step_input(frozenset({0}))
    assert [len(s.token_ids) for s in step.seqs] == [1, 1, 1, 1]  # drafts come from the worker
    assert [s.num_draft_tokens for s in step.seqs] == [K, 1, 0, 0]
    # plain: 2 accepted + 1; near_end: all; the others one token
    scheduler.postprocess_steps(batch, [[1, 2, 3], [4, 6], [8], [9]], None, [8, 7, 7, 7])
    assert plain.output_token_ids == [5, 1, 2, 3] and plain.num_computed_tokens == 8
    assert plain.num_draft_computed_tokens == 8
    assert near_end.is_finished and near_end.output_token_ids == [5, 4, 6]
    assert penalised.num_computed_tokens == penalised.num_tokens - 1
    assert plain.num_published_blocks * BLOCK <= plain.num_tokens  # real tokens only
    scheduler.block_manager.check_invariant([plain, penalised, held])


def test_rows_return_between_one_and_j_plus_one_tokens() -> None:
    scheduler, factory = make(), SequenceFactory()
    add(scheduler, factory, 5, max_tokens=20)
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None
    with pytest.raises(ValueError, match="drafts per row"):
        scheduler.postprocess_steps(batch, [[1] * (K + 2)])
    postprocess(scheduler, batch, [1])  # no draft accepted: still fine


def test_drafts_never_preempt() -> None:
    scheduler, factory = make(num_blocks=5), SequenceFactory()
    a = add(scheduler, factory, 7, max_tokens=5)
    b = add(scheduler, factory, 7, max_tokens=5)
    prefill(scheduler)  # 8 tokens each: 2 blocks each, one block free
    batch = scheduler.schedule()
    assert batch is not None and scheduler.num_running == 2 and scheduler.num_waiting == 0
    assert list(batch.num_draft_tokens) == [3, 0]  # b's drafts would need a sixth block
    assert len(a.block_table) == 3 and len(b.block_table) == 2


def test_preemption_resets_the_drafts_kv_count() -> None:
    scheduler, factory = make(), SequenceFactory()
    seq = add(scheduler, factory, 5, max_tokens=20)
    prefill(scheduler)
    assert seq.num_draft_computed_tokens == 5
    scheduler.preempt_all()
    assert seq.num_draft_computed_tokens == 0 and seq.num_computed_tokens == 0


def make_rounds(num_blocks: int = 64, chunked: bool = True, max_model_len: int = 64) -> Scheduler:
    """A scheduler whose speculative decodes may run ``ROUNDS`` rounds per batch."""
    config = SchedulerConfig(8, 64, max_model_len, num_decode_steps=ROUNDS, max_multi_step_seqs=8,
                             enable_chunked_prefill=chunked, num_speculative_tokens=K)  # fmt: skip
    return Scheduler(config, BlockManager(num_blocks, BLOCK, True), frozenset({0}))


ROUNDS = 2


@pytest.mark.parametrize("chunked", [True, False])
def test_full_draft_decodes_run_rounds_with_the_blocks_of_every_round(chunked: bool) -> None:
    scheduler, factory = make_rounds(chunked=chunked), SequenceFactory()
    a = add(scheduler, factory, 5, max_tokens=20)
    b = add(scheduler, factory, 6, max_tokens=20)
    prefill(scheduler)
    batch = scheduler.schedule()
    assert batch is not None and batch.num_steps == ROUNDS
    assert list(batch.num_draft_tokens) == [K, K]
    for seq in (a, b):  # positions up to ROUNDS * (K + 1) - 1 past the newest token
        assert len(seq.block_table) * BLOCK >= seq.num_tokens + ROUNDS * (K + 1) - 1
    with pytest.raises(ValueError, match="drafts per row"):  # fewer than one token per round
        scheduler.postprocess_steps(batch, [[1], [1, 2]])
    # a: every draft of both rounds accepted; b: one token per round
    scheduler.postprocess_steps(batch, [list(range(1, 9)), [1, 2]], None, [14, 8])
    assert a.output_token_ids == [5, *range(1, 9)] and a.num_computed_tokens == 13
    assert b.output_token_ids == [5, 1, 2] and b.num_draft_computed_tokens == 8
    scheduler.block_manager.check_invariant([a, b])


@pytest.mark.parametrize(
    "case", ["a row near its end", "a row near max_model_len", "a waiting prompt", "no blocks"]
)
def test_decodes_run_one_round_when_some_row_cannot_run_them_all(case: str) -> None:
    # 8 tokens + 7 positions of lookahead pass 14; drafts for both fit 7 blocks, rounds not
    max_model_len = 14 if case == "a row near max_model_len" else 64
    num_blocks = 7 if case == "no blocks" else 64
    scheduler = make_rounds(num_blocks=num_blocks, max_model_len=max_model_len)
    factory = SequenceFactory()
    add(scheduler, factory, 5, max_tokens=20)
    add(scheduler, factory, 7 if case == "a row near max_model_len" else 5,
        max_tokens=ROUNDS if case == "a row near its end" else 20)  # fmt: skip
    prefill(scheduler)
    if case == "a waiting prompt":
        add(scheduler, factory, 5, max_tokens=20)
    batch = scheduler.schedule()
    assert batch is not None and batch.num_steps == 1
    if case != "a waiting prompt":
        assert list(batch.num_draft_tokens) == [K, K if case != "a row near its end" else 0]
