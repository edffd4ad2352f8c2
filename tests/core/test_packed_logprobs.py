"""A decode step's packed logprobs (``PackedLogprobs``, ``RowLogprobs``) read as the tuples of
``TokenLogprobs`` they replace, on every layout; and the engine's column path (``logprobs=0``)
records what the per-entry path records."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from dormant.core.packed_logprobs import PackedLogprobs, RowLogprobs, unpack_logprobs
from dormant.core.sampling_params import SamplingParams
from dormant.core.step_output import SeqOutput, StepOutput
from dormant.engine.logprob_positions import LogprobPositions
from dormant.engine.output_processor import OutputProcessor
from dormant.engine.sequence import Sequence
from dormant.engine.tokenizer import ByteTokenizer


def random_packed(rng: np.random.Generator, num_entries: int, num_top: int) -> np.ndarray:
    packed = rng.integers(0, 250, (num_entries, 3 + 2 * num_top), dtype=np.int32)
    values = packed.view(np.float32)
    values[:, 2] = -rng.random(num_entries, dtype=np.float32) * 10
    values[:, 3 + num_top :] = -rng.random((num_entries, num_top), dtype=np.float32) * 10
    return packed


def expected_rows(packed: np.ndarray, num_rows: int) -> list[tuple]:
    """What read_step_output gave before: each row's entries, step-major, as tuples."""
    entries = unpack_logprobs(packed)
    num_steps = len(packed) // num_rows if num_rows else 0
    return [tuple(entries[s * num_rows + r] for s in range(num_steps)) for r in range(num_rows)]


@pytest.mark.parametrize("num_top", [0, 1, 4])
@pytest.mark.parametrize("num_steps", [1, 4])
@pytest.mark.parametrize("num_rows", [0, 1, 5])
def test_rows_read_as_the_unpacked_tuples(num_top: int, num_steps: int, num_rows: int) -> None:
    rng = np.random.default_rng(100 * num_top + 10 * num_steps + num_rows)
    packed = random_packed(rng, num_steps * num_rows, num_top)
    rows = PackedLogprobs(packed.copy(), num_rows).rows()
    expected = expected_rows(packed, num_rows)
    assert len(rows) == num_rows
    for row, want in zip(rows, expected, strict=True):
        assert len(row) == num_steps
        assert row == want and want == row  # either side's __eq__
        assert tuple(row) == want and list(row) == list(want)
        assert [row[i] for i in range(-num_steps, num_steps)] == [*want, *want]
        assert row[1:] == want[1:] and row[::-1] == want[::-1] and row[:0] == ()
        assert hash(row) == hash(want)
        with pytest.raises(IndexError):
            row[num_steps]
        with pytest.raises(IndexError):
            row[-num_steps - 1]
        for count in range(num_steps + 2):
            ids, values, ranks = row.columns(count)
            first = want[:count]
            assert ids == [e.token_ids[0] for e in first]
            assert values == [e.logprobs[0] for e in first]
            assert ranks == [e.ranks[0] for e in first]
            assert all(type(v) is float for v in values)
    if num_rows > 1:
        assert rows[0] != rows[1]  # random entries differ


def test_rows_pickle_and_own_their_values() -> None:
    rng = np.random.default_rng(7)
    packed = random_packed(rng, 4 * 3, 2)
    expected = expected_rows(packed, 3)
    block = PackedLogprobs(packed.copy(), 3)
    output = StepOutput(tuple(SeqOutput((1, 2, 3, 4), row) for row in block.rows()))
    packed[:] = 0  # the caller's buffer reused: the block holds its own copy
    copied = pickle.loads(pickle.dumps(output))
    assert [o.logprobs for o in copied.seqs] == expected == [o.logprobs for o in output.seqs]
    assert type(copied.seqs[0].logprobs) is RowLogprobs


def test_seq_output_is_a_named_tuple_with_defaults() -> None:
    out = SeqOutput((5,))
    assert (out.logprobs, out.prompt_logprobs, out.num_draft_computed_tokens) == (None,) * 3
    changed = out._replace(num_draft_computed_tokens=2)
    assert changed == SeqOutput((5,), None, None, 2) and out.num_draft_computed_tokens is None


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), None])
def test_sampled_first_is_sampled_of_first_tokens(tokenizer: ByteTokenizer | None) -> None:
    rng = np.random.default_rng(3)
    packed = random_packed(rng, 6, 0)
    packed[3, 0] = packed[1, 0]  # a repeated id: its memoized text
    row = PackedLogprobs(packed, 1).rows()[0]
    tokens = [e.token_ids[0] for e in row]
    first = LogprobPositions(tokenizer).sampled_first(7, tokens, *row.columns(6))
    assert first == LogprobPositions(tokenizer).sampled(7, 0, tokens, tuple(row))
    assert all(next(iter(p.values())).decoded_token is None for p in first) == (tokenizer is None)
    positions = LogprobPositions(tokenizer)
    wrong = [*tokens[:2], tokens[2] + 1, *tokens[3:]]
    with pytest.raises(RuntimeError, match="request 7: the worker's logprobs are for token"):
        positions.sampled_first(7, wrong, *row.columns(6))
    with pytest.raises(ValueError):  # fewer entries than tokens, as sampled's strict zip
        positions.sampled_first(7, [*tokens, 5], *row.columns(6))


@pytest.mark.parametrize("num_logprobs", [0, 2])
@pytest.mark.parametrize("num_top", [0, 2])
def test_output_processor_records_rows_as_tuples(num_logprobs: int, num_top: int) -> None:
    """The same step recorded from a RowLogprobs (the column path where it applies) and from
    its tuple (the per-entry path): the same positions, texts and cumulative logprob, cut at
    the tokens the sequence appended."""
    if num_logprobs > num_top and num_top:
        pytest.skip("the worker carries at least the top tokens asked for")
    rng = np.random.default_rng(num_logprobs + 10 * num_top)
    num_steps, num_rows = 4, 2
    packed = random_packed(rng, num_steps * num_rows, num_top)
    rows = PackedLogprobs(packed, num_rows).rows()
    recorded = []
    for as_tuple in (False, True):
        processor = OutputProcessor(ByteTokenizer())
        params = SamplingParams(logprobs=num_logprobs, n=num_rows, temperature=1.0)
        seqs = [Sequence(i, [65, 66], params, i) for i in range(num_rows)]
        processor.add(0, None, [65, 66], params, seqs)
        outputs = []
        for row, seq in zip(rows, seqs, strict=True):
            seq.output_token_ids.extend(e.token_ids[0] for e in row[:3])  # stopped after 3
            outputs.append(SeqOutput((0,) * num_steps, tuple(row) if as_tuple else row))
        processor.record_step(seqs, outputs, [0] * num_rows)
        output = processor.output(0)
        assert output is not None
        recorded.append([(c.logprobs, c.cumulative_logprob) for c in output.outputs])
    assert recorded[0] == recorded[1]
    assert all(len(logprobs) == 3 for logprobs, _ in recorded[0])
