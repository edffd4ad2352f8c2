"""``InputBuffers.load``: what it stages equals what the step says, step after step, while it
skips rewriting block-table rows whose blocks did not change (``_stage_block_tables``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dormant.core.config import EngineConfig
from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.memory import MemoryManager
from dormant.models import ModelConfig
from dormant.worker.input_buffers import InputBuffers

BLOCK_SIZE = 4
NULL_BLOCK = 99
MODEL = ModelConfig.from_dict(
    {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 64,
        "torch_dtype": "float32",
    }
)  # fmt: skip
PARAMS = SamplingParams(temperature=0.0)


@pytest.fixture
def buffers() -> InputBuffers:
    config = EngineConfig.create(MODEL, max_model_len=64, max_num_seqs=6, block_size=BLOCK_SIZE)
    return InputBuffers(MemoryManager("host"), config, null_block=NULL_BLOCK)


def row(tokens: list[int], start: int, table: list[int]) -> SeqInput:
    # A new tuple every time, as the scheduler sends it each step.
    return SeqInput(tuple(tokens), start, tuple(table), PARAMS, seed=0, num_output_tokens=0)


def check(buffers: InputBuffers, step: StepInput, pad_to: int | None = None) -> None:
    """Loads ``step`` and asserts every entry a kernel reads against the step itself."""
    meta = buffers.load(step, pad_to)
    ids, positions, slots, tables = [], [], [], []
    for seq in step.seqs:
        for i, token in enumerate(seq.token_ids):
            position = seq.start_position + i
            ids.append(token)
            positions.append(position)
            slots.append(
                seq.block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            )
        tables.append(list(seq.block_table))
    num_tokens, num_seqs = len(ids), len(step.seqs)
    assert buffers.input_ids[:num_tokens].tolist() == ids
    assert buffers.positions[:num_tokens].tolist() == positions
    assert meta.slot_mapping[:num_tokens].tolist() == slots
    for r, table in enumerate(tables):  # the first len entries are read; the rest is padding
        assert meta.block_tables[r, : len(table)].tolist() == table, f"row {r}"
    lens = [len(s.token_ids) for s in step.seqs]
    assert meta.seq_lens[:num_seqs].tolist() == [s.seq_len for s in step.seqs]
    assert meta.query_start_loc[: num_seqs + 1].tolist() == np.cumsum([0, *lens]).tolist()
    assert buffers.logits_indices[:num_seqs].tolist() == (np.cumsum(lens) - 1).tolist()
    assert meta.max_query_len == max(lens)
    assert meta.max_seq_len == max(s.seq_len for s in step.seqs)
    for r in range(num_seqs, pad_to or num_seqs):  # padding rows: one token in the null block
        assert meta.block_tables[r].tolist() == [NULL_BLOCK] * meta.block_tables.shape[1]
        assert meta.slot_mapping[r] == NULL_BLOCK * BLOCK_SIZE and meta.seq_lens[r] == 1


def decode(*rows: tuple[int, list[int]]) -> StepInput:
    return StepInput(tuple(row([7], start, table) for start, table in rows), is_prefill=False)


def test_load_stages_every_step_as_sent(buffers: InputBuffers) -> None:
    a, b, c, d = [1, 2], [3, 4, 5], [6], [10, 11, 12]
    check(buffers, StepInput((row([5, 6, 7], 1, a), row([8, 9], 7, b)), is_prefill=True))
    check(buffers, decode((6, a), (9, b), (2, c)))
    check(buffers, decode((7, a), (10, b), (3, c)))  # the same blocks again: no row written
    check(buffers, decode((8, [*a, 20]), (11, b), (3, c)))  # row 0 grew a block
    check(buffers, decode((8, [1, 21, 20]), (11, b), (3, c)))  # a middle block changed
    check(buffers, decode((10, d), (8, [1, 21, 20]), (11, b)))  # other sequences in each row
    check(buffers, decode((3, c)), pad_to=4)  # rows 1..3 become padding
    # Row 1 gets the very blocks it held before the padding: they must be written again.
    check(buffers, decode((3, c), (8, [1, 21, 20]), (11, b)))
    buffers.fill_padding()  # every row a dummy (graph capture)
    check(buffers, decode((3, c), (8, [1, 21, 20]), (11, b)))
    check(buffers, StepInput((row([1, 2], 4, d), row([3], 2, c)), is_prefill=True))


def test_padding_needs_a_decode(buffers: InputBuffers) -> None:
    with pytest.raises(ValueError, match="only decode steps"):
        buffers.load(StepInput((row([1, 2], 0, [1]),), is_prefill=True), pad_to=4)


def test_block_tables_stay_at_their_addresses(buffers: InputBuffers) -> None:
    before = [t.data_ptr() for t in buffers.tensors()]
    check(buffers, decode((3, [1]), (5, [2, 3])), pad_to=4)
    assert [t.data_ptr() for t in buffers.tensors()] == before
    assert all(t.device == torch.device("cpu") for t in buffers.tensors())


def test_rows_that_grow_get_their_new_blocks_and_others_are_rewritten(
    buffers: InputBuffers,
) -> None:
    """A table that only grew has its new entries written alone (``_stage_block_tables``);
    one that grew but changed before its end, or shrank, or holds another sequence, is
    written whole. Every row of every step is checked against the step."""
    a, b, c, d = [1, 2], [3, 4, 5], [6], [10, 11, 12]
    check(buffers, decode((6, a), (9, b), (2, c), (8, d)))
    check(buffers, decode((8, [*a, 20]), (12, [*b, 21]), (4, [*c, 22, 23]), (8, d)))
    check(buffers, decode((9, [7, 2, 20, 24]), (12, [*b, 21]), (4, [*c, 22, 23]), (8, d)))
    check(buffers, decode((9, [7, 2, 20, 24]), (4, [3, 4]), (4, [6, 22, 23]), (2, [10])))
    check(buffers, decode((9, [7, 2, 20, 24]), (8, d), (4, [*c, 22, 23])))  # fewer rows
    same = decode((9, [7, 2, 20, 24]), (8, d), (4, [*c, 22, 23]))
    check(buffers, same)
    check(buffers, same)  # the very tuples again: every row hits
    check(buffers, decode((9, [7, 2, 20, 24, 25]), (8, d), (4, [*c, 22, 23]), (5, [30, 31])))


def test_rows_after_a_launch_take_its_tokens_on_the_device(buffers: InputBuffers) -> None:
    """Async scheduling: rows with ``previous_rows`` gather their input tokens from the last
    launch's (``keep_last_tokens``); the host's placeholders are overwritten."""
    last = buffers.keep_last_tokens(torch.tensor([40, 41, 42]))
    step = decode((6, [1, 2]), (9, [3, 4, 5]))
    after = StepInput(step.seqs, is_prefill=False, previous_rows=(2, 0))
    buffers.load(after, pad_to=4, previous_tokens=last)
    assert buffers.input_ids[:2].tolist() == [42, 40]
    assert buffers.input_ids[2:4].tolist() == [0, 0]  # padding rows keep their dummy token
    assert last.tolist() == [40, 41, 42]


@pytest.mark.parametrize("rows", [(0, 3), (0,), (-1, 0)], ids=["past-end", "short", "negative"])
def test_bad_previous_rows_are_refused_before_anything_is_written(
    buffers: InputBuffers, rows: tuple[int, ...]
) -> None:
    last = buffers.keep_last_tokens(torch.tensor([40, 41, 42]))
    check(buffers, decode((6, [1, 2]), (9, [3, 4, 5])))
    before = {name: t.clone() for name, t in buffers.device_buffers.items()}
    step = decode((7, [1, 2]), (10, [3, 4, 5]))
    with pytest.raises(ValueError, match="previous_rows"):
        buffers.load(StepInput(step.seqs, False, previous_rows=rows), previous_tokens=last)
    for name, tensor in buffers.device_buffers.items():
        assert torch.equal(tensor, before[name]), name
