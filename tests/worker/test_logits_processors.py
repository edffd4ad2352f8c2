"""Penalties, min_p, min_tokens and bad words against hand-computed references on small logits
(vLLM's semantics), and what ``ScheduledBatch.step_input`` sends for them."""

from __future__ import annotations

import math

import pytest
import torch

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput
from dormant.engine.batch import ScheduledBatch
from dormant.engine.sequence import Sequence
from dormant.worker.input_buffers import Staging
from dormant.worker.penalties import LogitsProcessors

INF = float("inf")
VOCAB_SIZE = 6


def seq_input(params: SamplingParams, **fields: object) -> SeqInput:
    return SeqInput((1,), 4, (0,), params, seed=0, num_output_tokens=2, **fields)  # type: ignore[arg-type]


def apply(logits: list[list[float]], seqs: list[SeqInput]) -> list[list[float]]:
    processors = LogitsProcessors.build(seqs, VOCAB_SIZE, Staging(torch.device("cpu"), 2))
    tensor = torch.tensor(logits)
    if processors is not None:
        processors.apply(tensor)
    return tensor.tolist()


def test_rows_without_features_build_nothing() -> None:
    seqs = [seq_input(SamplingParams()), seq_input(SamplingParams(temperature=0.0))]
    staging = Staging(torch.device("cpu"))
    assert LogitsProcessors.build(seqs, VOCAB_SIZE, staging) is None


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    params = SamplingParams(repetition_penalty=2.0)
    seq = seq_input(params, output_token_ids=(1, 1), prompt_token_ids=(3, 4))
    # seen: 1 (output), 3, 4 (prompt). 3 is positive: /2; 4 is negative: *2; 0.0 stays.
    logits = [[1.0, 2.0, -1.0, 3.0, -0.5, 0.0]]
    assert apply(logits, [seq]) == [[1.0, 1.0, -1.0, 1.5, -1.0, 0.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    seq = seq_input(params, output_token_ids=(2, 2, 2, 5))
    logits = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    # token 2: count 3 -> 2 - 0.5 - 0.75; token 5: count 1 -> 5 - 0.5 - 0.25
    assert apply(logits, [seq]) == [[0.0, 1.0, 0.75, 3.0, 4.0, 4.25]]


def test_penalties_apply_to_their_rows_only() -> None:
    plain = seq_input(SamplingParams())
    penalised = seq_input(
        SamplingParams(repetition_penalty=4.0, frequency_penalty=1.0),
        output_token_ids=(0,),
        prompt_token_ids=(1,),
    )
    logits = [[8.0, 8.0, 8.0, 8.0, 8.0, 8.0]] * 3
    result = apply(logits, [plain, penalised, plain])
    assert result[0] == result[2] == logits[0]
    assert result[1] == [8.0 / 4 - 1.0, 2.0, 8.0, 8.0, 8.0, 8.0]


def test_min_tokens_masks_the_stop_ids_it_is_given() -> None:
    seq = seq_input(SamplingParams(min_tokens=5), masked_stop_token_ids=(0, 4))
    assert apply([[1.0] * VOCAB_SIZE], [seq]) == [[-INF, 1.0, 1.0, 1.0, -INF, 1.0]]


def test_bad_words_mask_single_tokens_always_and_longer_words_after_their_prefix() -> None:
    words = ((3,), (1, 2), (4, 1, 5), (2, 0))
    matched = seq_input(SamplingParams(), output_token_ids=(9, 4, 1), bad_words_token_ids=words)
    # (3,) always; (1, 2): outputs end with 1 -> mask 2; (4, 1, 5): end with 4, 1 -> mask 5;
    # (2, 0): outputs do not end with 2.
    assert apply([[0.0] * VOCAB_SIZE], [matched]) == [[0.0, 0.0, -INF, -INF, 0.0, -INF]]
    short = seq_input(SamplingParams(), output_token_ids=(1,), bad_words_token_ids=((0, 1, 2),))
    assert apply([[0.0] * VOCAB_SIZE], [short]) == [
        [0.0] * VOCAB_SIZE
    ]  # prefix longer than outputs


def test_penalties_without_their_history_raise() -> None:
    seq = seq_input(SamplingParams(presence_penalty=1.0))
    with pytest.raises(ValueError, match="output_token_ids"):
        apply([[0.0] * VOCAB_SIZE], [seq])


def make_sequence(params: SamplingParams, outputs: list[int]) -> Sequence:
    seq = Sequence(0, [7, 8, 9], params, seed=1)
    seq.output_token_ids.extend(outputs)
    seq.block_table = [0]
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_step_input_sends_each_feature_only_to_the_requests_that_use_it() -> None:
    plain = make_sequence(SamplingParams(), [1, 2])
    presence = make_sequence(SamplingParams(presence_penalty=0.5), [1, 2])
    repetition = make_sequence(SamplingParams(repetition_penalty=1.2), [1, 2])
    min_tokens = make_sequence(SamplingParams(min_tokens=3, stop_token_ids=[6, 2]), [1, 2])
    ignore_eos = make_sequence(SamplingParams(min_tokens=3, ignore_eos=True), [1])
    done = make_sequence(SamplingParams(min_tokens=2, stop_token_ids=[6]), [1, 2])
    batch = ScheduledBatch.of(
        [(s, 1) for s in (plain, presence, repetition, min_tokens, ignore_eos, done)]
    )
    seqs = batch.step_input(frozenset({5, 2})).seqs
    assert seqs[0].output_token_ids is None and seqs[0].prompt_token_ids is None
    assert seqs[0].masked_stop_token_ids == () and seqs[0].bad_words_token_ids == ()
    assert seqs[1].output_token_ids == (1, 2) and seqs[1].prompt_token_ids is None
    assert seqs[2].output_token_ids == (1, 2) and seqs[2].prompt_token_ids == (7, 8, 9)
    assert seqs[3].masked_stop_token_ids == (2, 5, 6)
    assert seqs[4].masked_stop_token_ids == ()
    assert seqs[5].masked_stop_token_ids == ()
    assert not any(s.compute_prompt_logprobs for s in seqs)


def test_prompt_logprobs_are_asked_on_the_first_prefill_only() -> None:
    params = SamplingParams(prompt_logprobs=1)
    first = make_sequence(params, [])
    first.num_computed_tokens = 0
    recompute = make_sequence(params, [4])  # preempted after one output: prefill again
    recompute.num_computed_tokens = 0
    seqs = ScheduledBatch.of([(first, 3), (recompute, 4)]).step_input(frozenset()).seqs
    assert [s.compute_prompt_logprobs for s in seqs] == [True, False]
    assert seqs[1].token_ids == (7, 8, 9, 4)


def test_advanced_stops_masking_once_min_tokens_is_reached() -> None:
    seq = seq_input(SamplingParams(min_tokens=4), masked_stop_token_ids=(5,), output_token_ids=())
    once = seq.advanced(3)
    assert once.masked_stop_token_ids == (5,) and once.output_token_ids == (3,)
    assert once.start_position == 5 and once.token_ids == (3,) and once.num_output_tokens == 3
    assert once.advanced(4).masked_stop_token_ids == ()


def test_min_p_matches_the_probability_definition() -> None:
    """p < min_p * p_max is masked (vLLM's MinPLogitsProcessor), after the temperature."""
    from dormant.worker.sampler import SamplingTensors, sample_and_process

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]])
    params = SamplingParams(temperature=0.5, min_p=0.1, seed=0)
    t = SamplingTensors.from_sequences([seq_input(params)], VOCAB_SIZE, "cpu")
    _, processed = sample_and_process(logits, t, keep_processed=True)
    scaled = logits[0] / 0.5
    probs = scaled.softmax(-1)
    expected = scaled.masked_fill(probs < 0.1 * probs.max(), -INF)
    assert processed is not None and processed[0].tolist() == expected.tolist()
    assert math.isinf(expected[3]) and not math.isinf(expected[1])
