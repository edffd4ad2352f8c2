"""The fork of a request's ``n`` samples, end to end on the CPU (fp32): every sample equals the
same sample computed alone (sample ``i`` of a request seeded ``s`` is the request of one sample
seeded ``s + i``), the prompt is computed once, and the fallbacks (prompt logprobs, block
pressure, a leader preempted, an abort) keep every output right."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dormant import LLM, SamplingParams
from dormant.engine.batch import ScheduledBatch

pytestmark = pytest.mark.parametrize("device", ["cpu"])
PARTIAL = [(11 * i + 5) % 500 + 1 for i in range(22)]  # 5 full blocks of 4, and 2 more
MULTIPLE = [(13 * i + 7) % 500 + 1 for i in range(24)]  # 6 full blocks of 4
# Greedy in effect (top-k 1: vLLM refuses n > 1 at temperature 0)
ARGMAX = SamplingParams(n=4, temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=1)


def samples(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[Any]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[tuple(c.token_ids) for c in o.outputs] for o in outputs]


def alone(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[Any]]:
    """Each sample as a request of its own (seed ``seed + i``): nothing to fork from."""
    per_sample = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        one = replace(params, n=1, seed=seed)
        per_sample.append([s[0] for s in samples(llm, prompts, one)])
    return [list(row) for row in zip(*per_sample, strict=True)]


class Batches:
    """Records every batch the engine's scheduler hands out (as benchmarks/rollout.py does)."""

    def __init__(self, llm: LLM) -> None:
        self.batches: list[ScheduledBatch] = []
        scheduler = llm.llm_engine.scheduler
        schedule = scheduler.schedule

        def recorded() -> ScheduledBatch | None:
            batch = schedule()
            if batch is not None:
                self.batches.append(batch)
            return batch

        scheduler.schedule = recorded  # type: ignore[method-assign]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(b.num_prefill_tokens for b in self.batches)

    @property
    def num_fork_rows(self) -> int:
        return sum(sum(r is not None for r in b.fork_of) for b in self.batches)


@pytest.fixture
def engine(make_llm: Callable[..., LLM], checkpoint: Path) -> Iterator[Callable[..., LLM]]:
    def make(**options: object) -> LLM:
        defaults: dict[str, object] = dict(block_size=4, max_num_seqs=16)
        return make_llm(str(checkpoint), **{**defaults, **options})

    yield make


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_forked_samples_equal_samples_computed_alone(engine, chunked: bool) -> None:
    llm = engine(enable_chunked_prefill=chunked)
    prompts = [PARTIAL, MULTIPLE]
    for params in (ARGMAX, SEEDED):
        want = alone(llm, prompts, params)
        llm.reset_prefix_cache()
        log = Batches(llm)
        got = samples(llm, prompts, params)
        assert got == want
        assert log.num_fork_rows == 2 * (params.n - 1)
        assert log.num_prefill_tokens == len(PARTIAL) + len(MULTIPLE)  # each prompt once
    seeded = samples(llm, prompts, SEEDED)
    assert all(len(set(row)) == SEEDED.n for row in seeded)  # the samples differ
    assert all(len(set(row)) == 1 for row in samples(llm, prompts, ARGMAX))


def test_forked_logprobs_equal_logprobs_computed_alone(engine) -> None:
    llm = engine()
    one = replace(SEEDED, n=1, seed=SEEDED.seed + 2)  # sample 2's
    want = llm.generate([PARTIAL], one, use_tqdm=False)[0].outputs[0]
    llm.reset_prefix_cache()
    got = llm.generate([PARTIAL], SEEDED, use_tqdm=False)[0].outputs[2]
    assert got.token_ids == want.token_ids
    for entries, expected in zip(got.logprobs, want.logprobs, strict=True):
        assert entries.keys() == expected.keys()
        for token, logprob in entries.items():
            assert logprob.logprob == pytest.approx(expected[token].logprob, abs=1e-4)


def test_a_prompt_split_into_chunks_forks_at_its_last_chunk(engine) -> None:
    llm = engine(max_num_batched_tokens=16)  # PARTIAL's 22 tokens: a chunk of 16, then 6
    want = alone(llm, [PARTIAL], SEEDED)
    llm.reset_prefix_cache()
    log = Batches(llm)
    assert samples(llm, [PARTIAL], SEEDED) == want
    assert log.num_prefill_tokens == len(PARTIAL) and log.num_fork_rows == 3
    assert [b.num_new_tokens[0] for b in log.batches[:2]] == [16, 6]


def test_n8_computes_the_prompt_once(engine) -> None:
    """The counters benchmarks/rollout.py reads: prefill tokens (``num_prefill_tokens`` of the
    batches) and the prefix cache's hit rate, where a fork counts its prompt as cached."""
    llm = engine()
    params = replace(SEEDED, n=8, logprobs=0)
    log = Batches(llm)
    outputs = llm.generate([PARTIAL], params, use_tqdm=False)
    assert log.num_prefill_tokens == len(PARTIAL)
    assert outputs[0].num_cached_tokens == len(PARTIAL)
    stats = llm.memory_status()[0].prefix_cache
    assert stats.num_query_tokens == 8 * len(PARTIAL)
    assert stats.num_hit_tokens == 7 * len(PARTIAL)


def test_prompt_logprobs_fall_back(engine) -> None:
    llm = engine()
    params = replace(SEEDED, prompt_logprobs=1)
    want = alone(llm, [PARTIAL], params)
    log = Batches(llm)
    outputs = llm.generate([PARTIAL], params, use_tqdm=False)
    assert [[tuple(c.token_ids) for c in o.outputs] for o in outputs] == want
    assert log.num_fork_rows == 0
    assert log.num_prefill_tokens == 4 * len(PARTIAL)  # prompt logprobs need every position
    assert outputs[0].prompt_logprobs is not None


def test_max_tokens_one(engine) -> None:
    llm = engine()
    params = replace(SEEDED, max_tokens=1)
    want = alone(llm, [PARTIAL, MULTIPLE], params)
    llm.reset_prefix_cache()
    log = Batches(llm)
    assert samples(llm, [PARTIAL, MULTIPLE], params) == want
    assert len(log.batches) == 1 and log.num_fork_rows == 6
    manager = llm.llm_engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_block_pressure_preempts_and_falls_back(engine) -> None:
    """40 blocks of 4 for 8 samples of 22 + 24 tokens: the forks' copies and decodes run out
    of blocks, the newest are preempted (recompute) or queued unforked; outputs stay right."""
    roomy = engine()
    params = replace(SEEDED, n=8, max_tokens=24, logprobs=None)
    want = alone(roomy, [PARTIAL], params)
    tight = engine(num_gpu_blocks_override=40)
    assert samples(tight, [PARTIAL], params) == want
    stats = tight.memory_status()[0].prefix_cache
    assert stats.num_query_tokens > 8 * len(PARTIAL)  # someone was prefilled again


def test_leader_preempted_by_a_sleep_before_its_prompt_completes(engine) -> None:
    llm = engine(max_num_batched_tokens=16, enable_sleep_mode=True)
    want = alone(llm, [PARTIAL], SEEDED)
    llm.reset_prefix_cache()
    engine_ = llm.llm_engine
    request_id = engine_.add_request(PARTIAL, SEEDED)
    engine_.step()  # the leader's first chunk; its siblings wait on it
    assert engine_.scheduler.num_waiting == 3
    llm.sleep(level=1, mode="keep")  # preempts the leader: its siblings are queued behind it
    assert llm.wake_up()
    outputs = []
    while engine_.has_unfinished_requests():
        outputs += engine_.step()
    assert len(outputs) == 1 and outputs[0].request_id == str(request_id)
    assert [[tuple(c.token_ids) for c in o.outputs] for o in outputs] == want


def test_abort_of_a_request_with_waiting_siblings(engine) -> None:
    llm = engine(max_num_batched_tokens=16)
    engine_ = llm.llm_engine
    request_id = engine_.add_request(PARTIAL, SEEDED)
    engine_.step()
    assert engine_.scheduler.num_waiting == 3 and engine_.scheduler.num_running == 1
    (aborted,) = engine_.abort_request([request_id])
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 4
    assert not engine_.has_unfinished_requests()
    manager = engine_.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert samples(llm, [PARTIAL], SEEDED) == alone(llm, [PARTIAL], SEEDED)
