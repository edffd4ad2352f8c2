"""Sequence state and the factory that numbers and seeds sequences."""

from __future__ import annotations

import random

import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.engine.sequence import (
    FinishReason,
    Sequence,
    SequenceFactory,
    SequenceFinishedError,
    SequenceStatus,
)


def test_new_sequence_state() -> None:
    seq = Sequence(7, [1, 2, 3], SamplingParams(), seed=11)
    assert seq.seq_id == 7
    assert seq.prompt_token_ids == (1, 2, 3)
    assert seq.output_token_ids == []
    assert seq.status is SequenceStatus.WAITING
    assert seq.finish_reason is None
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert seq.seed == 11
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.last_token_id == 3
    assert not seq.is_finished


def test_appending_tokens_updates_counts_and_last_token() -> None:
    seq = Sequence(0, [5, 6], SamplingParams(), seed=0)
    seq.append_token(9)
    seq.append_token(8)
    assert seq.token_ids == [5, 6, 9, 8]
    assert seq.output_token_ids == [9, 8]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (4, 2, 2)
    assert seq.last_token_id == 8


def test_token_ids_is_a_copy() -> None:
    seq = Sequence(0, [5, 6], SamplingParams(), seed=0)
    seq.token_ids.append(1)
    assert seq.num_tokens == 2


def test_finish_sets_reason_and_forbids_appending() -> None:
    seq = Sequence(0, [1], SamplingParams(), seed=0)
    seq.finish(FinishReason.LENGTH)
    assert seq.is_finished
    assert seq.status is SequenceStatus.FINISHED
    assert seq.finish_reason is FinishReason.LENGTH
    with pytest.raises(SequenceFinishedError, match="finished"):
        seq.append_token(1)


def test_finish_reason_values_are_openai_strings() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]
    assert FinishReason.STOP == "stop"


@pytest.mark.parametrize("prompt", [[], [1, -1]])
def test_invalid_prompts_raise(prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="sequence 3"):
        Sequence(3, prompt, SamplingParams(), seed=0)


def test_factory_numbers_sequences_and_uses_request_seed() -> None:
    factory = SequenceFactory(first_seq_id=10)
    a = factory.create([1], SamplingParams(seed=42))
    b = factory.create([1], SamplingParams(seed=42))
    assert (a.seq_id, b.seq_id) == (10, 11)
    assert a.seed == b.seed == 42


def test_factories_are_independent() -> None:
    assert SequenceFactory().create([1], SamplingParams()).seq_id == 0
    assert SequenceFactory().create([1], SamplingParams()).seq_id == 0


def test_factory_draws_seeds_from_its_rng() -> None:
    first = SequenceFactory(random.Random(1))
    second = SequenceFactory(random.Random(1))
    seeds = [first.create([1], SamplingParams()).seed for _ in range(4)]
    assert seeds == [second.create([1], SamplingParams()).seed for _ in range(4)]
    assert len(set(seeds)) == 4
    assert all(0 <= s < 2**64 for s in seeds)
