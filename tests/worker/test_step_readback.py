"""The host read-back of a step (``unpack_logprobs``, ``read_step_output``) equals the plain
per-row reading it replaced, on every layout: steps, widths, rows without logprobs, prompts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput
from dormant.core.step_output import SeqOutput, StepOutput, TokenLogprobs
from dormant.worker.logprobs import packed_width, unpack_logprobs
from dormant.worker.step_readback import read_step_output


def reference_unpack(packed: np.ndarray) -> list[TokenLogprobs]:
    """One row at a time, as the packed layout reads (``logprobs.py``'s table)."""
    num_top = (packed.shape[-1] - 3) // 2
    values = packed.view(np.float32)
    entries = []
    for row in range(packed.shape[0]):
        ids = (int(packed[row, 0]), *(int(t) for t in packed[row, 3 : 3 + num_top]))
        logprobs = (float(values[row, 2]), *(float(v) for v in values[row, 3 + num_top :]))
        ranks = (int(packed[row, 1]), *range(1, num_top + 1))
        entries.append(TokenLogprobs(ids, logprobs, ranks))
    return entries


def reference_read(
    host: np.ndarray,
    seqs: list[SeqInput],
    num_steps: int,
    width: int | None,
    prompt_width: int | None,
) -> StepOutput:
    num_seqs = len(seqs)
    end = num_steps * num_seqs
    tokens = host[:end].reshape(num_steps, num_seqs).T.tolist()
    per_token = None
    if width is not None:
        packed = host[end : end + end * width].reshape(-1, width)
        end += packed.size
        per_token = reference_unpack(packed)
    prompt_entries = []
    if prompt_width is not None:
        prompt_entries = reference_unpack(host[end:].reshape(-1, prompt_width))
    outputs, next_prompt = [], 0
    for row, seq in enumerate(seqs):
        seq_logprobs = None
        if per_token is not None and seq.params.logprobs is not None:
            seq_logprobs = tuple(per_token[s * num_seqs + row] for s in range(num_steps))
        seq_prompt = None
        if seq.compute_prompt_logprobs:
            count = len(seq.token_ids) - 1
            seq_prompt = tuple(prompt_entries[next_prompt : next_prompt + count])
            next_prompt += count
        outputs.append(SeqOutput(tuple(tokens[row]), seq_logprobs, seq_prompt))
    return StepOutput(tuple(outputs))


def random_packed(rng: np.random.Generator, num_rows: int, num_top: int) -> np.ndarray:
    packed = rng.integers(0, 1000, (num_rows, packed_width(num_top)), dtype=np.int32)
    values = packed.view(np.float32)
    values[:, 2] = -rng.random(num_rows, dtype=np.float32) * 10
    values[:, 3 + num_top :] = -rng.random((num_rows, num_top), dtype=np.float32) * 10
    return packed


@pytest.mark.parametrize("num_top", [0, 1, 5])
@pytest.mark.parametrize("num_rows", [0, 1, 7])
def test_unpack_logprobs_matches_rows(num_top: int, num_rows: int) -> None:
    packed = random_packed(np.random.default_rng(num_top * 10 + num_rows), num_rows, num_top)
    entries = unpack_logprobs(packed)
    assert entries == reference_unpack(packed)
    assert all(type(entry) is TokenLogprobs for entry in entries)
    assert all(entry.ranks[1:] == tuple(range(1, num_top + 1)) for entry in entries)


@pytest.mark.parametrize("case", range(24))
def test_read_step_output_matches_rows(case: int) -> None:
    rand, rng = random.Random(case), np.random.default_rng(case)
    num_seqs = rand.choice([0, 1, 3, 8])
    num_steps = rand.choice([1, 1, 4])
    num_top = rand.choice([None, 0, 2])
    seqs = []
    for _ in range(num_seqs):
        asks = num_top is not None and rand.random() < 0.7
        params = SamplingParams(logprobs=rand.choice([0, 2]) if asks else None)
        is_prompt = num_steps == 1 and rand.random() < 0.5
        token_ids = tuple(
            rand.randrange(100) for _ in range(rand.randint(1, 6) if is_prompt else 1)
        )
        seqs.append(SeqInput(token_ids, 0, (0,), params, 0, 0, compute_prompt_logprobs=is_prompt))
    parts = [rng.integers(0, 1000, num_steps * num_seqs, dtype=np.int32)]
    width = None if num_top is None else packed_width(num_top)
    if num_top is not None:
        parts.append(random_packed(rng, num_steps * num_seqs, num_top).reshape(-1))
    num_prompt = sum(len(s.token_ids) - 1 for s in seqs if s.compute_prompt_logprobs)
    prompt_width = None
    if any(s.compute_prompt_logprobs for s in seqs):
        prompt_width = packed_width(1)
        parts.append(random_packed(rng, num_prompt, 1).reshape(-1))
    host = np.concatenate(parts)
    got = read_step_output(host, seqs, num_steps, width, prompt_width)
    assert got == reference_read(host, seqs, num_steps, width, prompt_width)


def test_read_step_output_keeps_its_logprobs_past_the_next_step() -> None:
    """The host buffer is the next step's: the decode logprobs, kept packed, are a copy."""
    rng = np.random.default_rng(5)
    num_seqs, num_steps = 3, 4
    seqs = [SeqInput((1,), 0, (0,), SamplingParams(logprobs=1), 0, 0) for _ in range(num_seqs)]
    tokens = rng.integers(0, 1000, num_steps * num_seqs, dtype=np.int32)
    packed = random_packed(rng, num_steps * num_seqs, 1).reshape(-1)
    host = np.concatenate([tokens, packed])
    expected = reference_read(host, seqs, num_steps, packed_width(1), None)
    got = read_step_output(host, seqs, num_steps, packed_width(1), None)
    host[:] = 0  # the next step's copy lands in the same buffer
    assert got == expected
