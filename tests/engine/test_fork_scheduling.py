"""The fork of a request's ``n`` samples from one prefill, in the scheduler and block manager:
fork rows share the leader's full blocks and copy its partial last block, and every case that
cannot fork cleanly falls back to an ordinary queued sequence, losing and duplicating none."""

from __future__ import annotations

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.batch import ScheduledBatch, SchedulerConfig
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import Scheduler
from dormant.engine.sequence import FinishReason, Sequence, SequenceFactory, SequenceStatus

EOS = 0
BLOCK = 4


def make(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 8,
    prefix_caching: bool = True,
    chunked: bool = True,
    **options: object,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs,
        budget,
        64,
        enable_chunked_prefill=chunked,
        **options,  # type: ignore[arg-type]
    )
    return Scheduler(config, BlockManager(num_blocks, BLOCK, prefix_caching), frozenset({EOS}))


def request(
    scheduler: Scheduler, num_tokens: int, n: int = 4, offset: int = 1, **params: object
) -> list[Sequence]:
    """Adds a request of ``n`` samples as the engine does: sample 0, then its siblings."""
    params.setdefault("max_tokens", 4)
    prompt = [(7 * i + offset) % 97 + 1 for i in range(num_tokens)]
    sampling = SamplingParams(n=n, **params)  # type: ignore[arg-type]
    factory = scheduler_factory(scheduler)
    seqs = [factory.create(prompt, sampling, index) for index in range(n)]
    for seq in seqs:
        scheduler.add(seq, fork_of=None if seq is seqs[0] else seqs[0])
    return seqs


def scheduler_factory(scheduler: Scheduler) -> SequenceFactory:
    factory = getattr(scheduler, "_test_factory", None)
    if factory is None:
        factory = SequenceFactory()
        scheduler._test_factory = factory  # type: ignore[attr-defined]
    return factory


def step(scheduler: Scheduler, token_id: int = 5) -> tuple[ScheduledBatch, list[Sequence]]:
    batch = scheduler.schedule()
    assert batch is not None
    all_seqs = [*scheduler._waiting, *scheduler._running]
    scheduler.block_manager.check_invariant(all_seqs)
    return batch, scheduler.postprocess_steps(batch, [[token_id]] * batch.num_seqs)


def fork_rows(batch: ScheduledBatch) -> dict[int, int]:
    """Fork rows' sequence ids -> their leaders' sequence ids."""
    return {
        seq.seq_id: batch.seqs[leader].seq_id
        for seq, leader in zip(batch.seqs, batch.fork_of or (None,) * batch.num_seqs, strict=True)
        if leader is not None
    }


@pytest.mark.parametrize("num_tokens", [10, 12], ids=["partial-block", "block-multiple"])
def test_siblings_fork_in_the_leaders_last_prefill_step(num_tokens: int) -> None:
    scheduler = make()
    leader, *siblings = request(scheduler, num_tokens)
    assert scheduler.num_waiting == 4 and len(scheduler._waiting) == 1
    batch = scheduler.schedule()
    assert batch is not None
    assert [s.seq_id for s in batch.seqs] == [s.seq_id for s in (leader, *siblings)]
    assert batch.num_new_tokens == (num_tokens, 0, 0, 0)
    assert batch.num_prefill_tokens == num_tokens and batch.is_prefill
    assert fork_rows(batch) == {s.seq_id: leader.seq_id for s in siblings}
    manager = scheduler.block_manager
    num_full = num_tokens // BLOCK
    for sibling in siblings:
        assert sibling.status is SequenceStatus.RUNNING
        assert sibling.num_computed_tokens == num_tokens == sibling.num_cached_tokens
        assert sibling.block_table[:num_full] == leader.block_table[:num_full]
    for block_id in leader.block_table[:num_full]:
        assert manager.num_holders(block_id) == 4
    if num_tokens % BLOCK:  # each sibling's own copy of the leader's partial last block
        last = leader.block_table[-1]
        assert batch.block_copies == tuple((last, s.block_table[-1]) for s in siblings)
        assert len({s.block_table[-1] for s in (leader, *siblings)}) == 4
    else:
        assert batch.block_copies == ()
        assert all(len(s.block_table) == num_full for s in siblings)
    step_input = batch.step_input(frozenset({EOS}))
    assert [s.fork_of for s in step_input.seqs] == [None, 0, 0, 0]
    assert [len(s.token_ids) for s in step_input.seqs] == [num_tokens, 0, 0, 0]
    assert step_input.block_copies == batch.block_copies
    computing, logits_rows = step_input.without_forks()
    assert len(computing.seqs) == 1 and logits_rows == [0, 0, 0, 0]
    manager.check_invariant([leader, *siblings])
    scheduler.postprocess_steps(batch, [[5]] * 4)
    assert all(s.output_token_ids == [5] for s in (leader, *siblings))
    stats = manager.prefix_cache_stats()
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (4 * num_tokens, 3 * num_tokens)
    while scheduler.has_unfinished:
        step(scheduler)
    assert manager.num_free_blocks == manager.num_blocks


def test_a_chunked_prompt_forks_at_its_last_chunk() -> None:
    scheduler = make(budget=8)
    leader, *siblings = request(scheduler, 19)
    batches = [step(scheduler)[0] for _ in range(3)]
    assert [b.num_new_tokens for b in batches[:2]] == [(8,), (8,)]
    assert batches[2].num_new_tokens == (3, 0, 0, 0)
    assert fork_rows(batches[2]) == {s.seq_id: leader.seq_id for s in siblings}
    assert sum(b.num_prefill_tokens for b in batches) == 19


@pytest.mark.parametrize(
    "case",
    ["no-prefix-caching", "fork-disabled", "speculative", "prompt-logprobs", "split-steps-seqs"],
)
def test_fallbacks_queue_the_siblings_as_ordinary_sequences(case: str) -> None:
    options: dict[str, object] = {}
    params: dict[str, object] = {}
    max_num_seqs = 8
    if case == "no-prefix-caching":
        options["prefix_caching"] = False
    elif case == "fork-disabled":
        options["enable_fork"] = False
    elif case == "speculative":
        options["num_speculative_tokens"] = 2
    elif case == "prompt-logprobs":
        params["prompt_logprobs"] = 1
    else:  # the fork step has room for one sibling only; whole prefills, no chunks
        max_num_seqs, options["chunked"] = 2, False
    scheduler = make(max_num_seqs=max_num_seqs, **options)  # type: ignore[arg-type]
    seqs = request(scheduler, 10, **params)
    batch, _ = step(scheduler)
    forked = fork_rows(batch)
    assert len(forked) == (1 if case == "split-steps-seqs" else 0)
    computed = {s.seq_id for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n}
    queued = [s.seq_id for s in scheduler._waiting]
    if forked:  # the siblings the step had no room for were queued behind the others
        assert queued == [s.seq_id for s in seqs[2:]] and computed == {seqs[0].seq_id}
    else:  # ordinary sequences, each computing (what the prefix cache does not give back)
        assert queued == [] and computed == {s.seq_id for s in seqs}
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 4 for s in seqs)


def test_no_free_block_for_the_copy_falls_back() -> None:
    scheduler = make(num_blocks=4, max_num_seqs=4)
    seqs = request(scheduler, 10, max_tokens=2)  # the leader's 3 blocks leave one free
    batch, _ = step(scheduler)
    assert len(fork_rows(batch)) == 1 and len(scheduler._waiting) == 2
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 2 for s in seqs)


def test_no_fork_across_a_prefix_cache_reset() -> None:
    """A reset (a weight change, a KV discard) while the leader is between chunks: its
    siblings share nothing and recompute the prompt."""
    scheduler = make(budget=8)
    leader, *siblings = request(scheduler, 19)
    step(scheduler)
    scheduler.block_manager.reset_prefix_cache()
    for _ in range(2):
        batch, _ = step(scheduler)
    assert fork_rows(batch) == {}
    assert [s.seq_id for s in scheduler._waiting] == [s.seq_id for s in siblings]
    step(scheduler)
    assert all(not set(s.block_table) & set(leader.block_table) for s in siblings)


def test_leader_preempted_before_its_prompt_completes_releases_its_siblings() -> None:
    scheduler = make(budget=8)
    leader, *siblings = request(scheduler, 19)
    step(scheduler)
    scheduler.preempt_all()
    queued = [s.seq_id for s in scheduler._waiting]
    assert queued == [s.seq_id for s in (leader, *siblings)]
    assert scheduler.num_waiting == 4
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 4 for s in (leader, *siblings))


def test_abort_of_a_request_with_waiting_siblings() -> None:
    scheduler = make(budget=8)
    seqs = request(scheduler, 19)
    other = request(scheduler, 6, offset=3, n=2)
    step(scheduler)
    aborted = scheduler.abort([s.seq_id for s in seqs])
    assert {s.seq_id for s in aborted} == {s.seq_id for s in seqs}
    assert all(s.finish_reason is FinishReason.ABORT for s in seqs)
    assert scheduler.num_waiting + scheduler.num_running == 2
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 4 for s in other)
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_aborting_only_the_leader_queues_its_siblings() -> None:
    scheduler = make(budget=8)
    leader, *siblings = request(scheduler, 19)
    step(scheduler)
    scheduler.abort([leader.seq_id])
    assert [s.seq_id for s in scheduler._waiting] == [s.seq_id for s in siblings]
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 4 for s in siblings)


def test_max_tokens_one_finishes_the_siblings_in_the_fork_step() -> None:
    scheduler = make()
    seqs = request(scheduler, 10, max_tokens=1)
    batch, finished = step(scheduler)
    assert len(fork_rows(batch)) == 3
    assert {s.seq_id for s in finished} == {s.seq_id for s in seqs}
    assert not scheduler.has_unfinished
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_forked_siblings_are_preempted_by_recompute() -> None:
    """Blocks run out while the forks decode: the newest sequences are preempted, freeing
    their shares and copies, and re-prefill as ordinary sequences."""
    scheduler = make(num_blocks=12, max_num_seqs=4)
    seqs = request(scheduler, 10, max_tokens=12)
    num_preempted = 0
    while scheduler.has_unfinished:
        before = {s.seq_id for s in scheduler._running}
        step(scheduler)
        num_preempted += len(before & {s.seq_id for s in scheduler._waiting})
    assert num_preempted > 0
    assert all(s.num_output_tokens == 12 for s in seqs)


def test_fork_rows_never_ride_a_decode_batch() -> None:
    """A leader whose cache hits leave exactly one token looks like a decode: with siblings
    to fork, the step is still a prefill step (eager), never a multi-step decode batch."""
    scheduler = make(num_decode_steps=4, max_multi_step_seqs=8)
    request(scheduler, 9, n=1)  # publishes 2 full blocks of the same prompt
    while scheduler.has_unfinished:
        step(scheduler)
    seqs = request(scheduler, 9)
    batch, _ = step(scheduler)
    assert batch.num_new_tokens == (1, 0, 0, 0) and batch.is_prefill and batch.num_steps == 1
    assert len(fork_rows(batch)) == 3
    assert batch.step_input(frozenset()).has_forks
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 4 for s in seqs)


@pytest.mark.parametrize("chunked", [True, False], ids=["mixed", "split"])
def test_a_request_starts_only_when_all_its_samples_fit(chunked: bool) -> None:
    """Two requests of 4 samples under max_num_seqs=6: the second leader waits until its
    whole family fits, so every sibling forks and each prompt is computed once (admitted
    beside the first, two of its siblings would have found no room and re-prefilled)."""
    scheduler = make(max_num_seqs=6, chunked=chunked)
    first = request(scheduler, 10)
    second = request(scheduler, 10, offset=3)
    forked: dict[int, int] = {}
    num_prefill_tokens = 0
    while scheduler.has_unfinished:
        batch, _ = step(scheduler)
        forked |= fork_rows(batch)
        num_prefill_tokens += batch.num_prefill_tokens
        assert len(scheduler._running) <= 6
    assert forked == {s.seq_id: seqs[0].seq_id for seqs in (first, second) for s in seqs[1:]}
    assert num_prefill_tokens == 2 * 10
    assert all(s.num_output_tokens == 4 for s in (*first, *second))


def test_a_chunked_leader_holds_its_siblings_slots() -> None:
    """A leader prefilling in chunks: a request that arrives meanwhile does not take the slots
    its siblings fork into at its last chunk."""
    scheduler = make(budget=8, max_num_seqs=4)
    leader, *siblings = request(scheduler, 19)
    step(scheduler)
    (single,) = request(scheduler, 3, n=1, offset=5)
    batches = [step(scheduler)[0] for _ in range(2)]
    assert single.status is SequenceStatus.WAITING
    assert fork_rows(batches[1]) == {s.seq_id: leader.seq_id for s in siblings}
    while scheduler.has_unfinished:
        step(scheduler)
    assert single.num_output_tokens == 4


def test_more_samples_than_max_num_seqs_still_run_when_nothing_else_does() -> None:
    scheduler = make(max_num_seqs=3)
    seqs = request(scheduler, 10, n=5)
    batch, _ = step(scheduler)
    assert len(fork_rows(batch)) == 2  # the rest queued as ordinary sequences
    while scheduler.has_unfinished:
        step(scheduler)
    assert all(s.num_output_tokens == 4 for s in seqs)
