"""Ranks and top-k against a torch reference, the packed layout, which rows get logprobs, the
logits modes, and the single-step path of ``execute_multi_step`` (CPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from worker_setup import BLOCK_SIZE, MAX_MODEL_LEN, VOCAB_SIZE

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.worker.cuda_graphs import DecodeGraphs
from dormant.worker.logprobs import (
    HostCopy,
    gather_logprobs,
    packed_width,
    trim_top,
    unpack_logprobs,
)
from dormant.worker.worker import Worker

BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
PROMPT = (11, 12, 13, 14, 15)


def reference_rank(values: torch.Tensor, token: int) -> int:
    return 1 + int((values > values[token]).sum())


def test_gather_logprobs_matches_a_sorting_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(7, 50, generator=generator).log_softmax(-1)
    values[3, 10] = values[3, 11] = values[3].max() + 1  # a tie at the top
    tokens = torch.tensor([0, 5, 49, 11, 2, 2, 30])
    packed = gather_logprobs(values, tokens, num_top=4)
    assert packed.dtype == torch.int32 and packed.shape == (7, 3 + 2 * 4)
    for row, entry in enumerate(unpack_logprobs(packed.numpy())):
        token = int(tokens[row])
        order = values[row].argsort(descending=True, stable=True)[:4]
        assert entry.token_ids == (token, *order.tolist())
        assert entry.logprobs == (float(values[row, token]), *values[row, order].tolist())
        assert entry.ranks == (reference_rank(values[row], token), 1, 2, 3, 4)
    assert unpack_logprobs(packed.numpy())[3].ranks[0] == 1  # ties share the better rank


def test_trim_top_keeps_the_best_entries() -> None:
    values = torch.randn(2, 3, 40).log_softmax(-1)
    tokens = torch.randint(0, 40, (2, 3))
    wide = torch.stack([gather_logprobs(values[s], tokens[s], 6) for s in range(2)])
    narrow = torch.stack([gather_logprobs(values[s], tokens[s], 2) for s in range(2)])
    assert torch.equal(trim_top(wide, 2), narrow)


def test_host_copy_round_trips_every_part() -> None:
    copy = HostCopy(torch.device("cpu"), capacity=4)
    parts = [torch.arange(3), torch.full((2, 5), -7, dtype=torch.int32)]
    copy.start(parts)
    assert copy.wait().tolist() == [0, 1, 2, *[-7] * 10]


def blocks(row: int) -> tuple[int, ...]:
    return tuple(range(row * BLOCKS_PER_SEQ, (row + 1) * BLOCKS_PER_SEQ))


def decode_batch(worker: Worker, params: list[SamplingParams], **fields: object) -> StepInput:
    """Prefills one prompt per entry of ``params`` and returns their first decode step."""
    seqs = tuple(
        SeqInput(PROMPT, 0, blocks(i), p, i, 0, **fields)  # type: ignore[arg-type]
        for i, p in enumerate(params)
    )
    first = worker.execute(StepInput(seqs, is_prefill=True)).seqs
    return StepInput(
        tuple(s.advanced(o.token_ids[0]) for s, o in zip(seqs, first, strict=True)), False
    )


def test_rows_without_logprobs_get_none(worker: Worker) -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    out = worker.execute(decode_batch(worker, params)).seqs
    assert out[0].logprobs is None and out[0].prompt_logprobs is None
    assert out[1].logprobs is not None and out[2].logprobs is not None
    # k is the batch's largest; the driver trims each request to its own.
    assert len(out[1].logprobs[0].token_ids) == len(out[2].logprobs[0].token_ids) == 3
    assert out[1].logprobs[0].token_ids[0] == out[1].token_ids[0]


def test_whole_vocabulary_logprobs(worker: Worker) -> None:
    out = worker.execute(decode_batch(worker, [SamplingParams(temperature=0.0, logprobs=-1)]))
    entry = out.seqs[0].logprobs[0]  # type: ignore[index]
    assert sorted(entry.token_ids[1:]) == list(range(VOCAB_SIZE))
    assert np.exp(entry.logprobs[1:]).sum() == pytest.approx(1.0, abs=1e-4)


@pytest.fixture
def logits_mode(worker: Worker) -> Iterator[None]:
    previous = worker.runner.logprobs_mode
    yield
    worker.runner.logprobs_mode = previous


@pytest.mark.usefixtures("logits_mode")
def test_logits_modes_return_logits(worker: Worker) -> None:
    params = [SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=6)]
    step = decode_batch(worker, params)
    results = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logits"):
        worker.runner.logprobs_mode = mode
        results[mode] = worker.execute(step).seqs[0].logprobs[0]  # type: ignore[index]
    raw_logprobs, raw_logits, processed = results.values()
    assert raw_logits.token_ids == raw_logprobs.token_ids  # same order, shifted values
    shift = np.array(raw_logits.logprobs) - np.array(raw_logprobs.logprobs)
    assert np.allclose(shift, shift[0], atol=1e-4) and abs(shift[0]) > 1e-3
    # processed: divided by the temperature; the sixth best is outside top-k 5.
    assert processed.token_ids[:6] == raw_logits.token_ids[:6]
    np.testing.assert_allclose(
        processed.logprobs[:6], np.array(raw_logits.logprobs[:6]) / 0.7, rtol=1e-5
    )
    assert processed.logprobs[6] == float("-inf")


def test_single_steps_equal_separate_decodes(worker: Worker) -> None:
    """``execute_multi_step``'s path for batches the fused graph does not fit (penalties here)."""
    params = [
        SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),
    ]
    step = decode_batch(worker, params, output_token_ids=(), prompt_token_ids=PROMPT)
    fused = worker.runner.execute_single_steps(step, 3).seqs
    seqs, separate = step.seqs, []
    for _ in range(3):
        out = worker.execute(StepInput(seqs, False)).seqs
        separate.append(out)
        seqs = tuple(s.advanced(o.token_ids[0]) for s, o in zip(seqs, out, strict=True))
    for row in range(2):
        assert fused[row].token_ids == tuple(s[row].token_ids[0] for s in separate)
    assert fused[0].logprobs == tuple(s[0].logprobs[0] for s in separate)  # type: ignore[index]
    assert fused[1].logprobs is None
    assert not worker.runner.fits_multi_step_graph(step.seqs)
    plain = [SeqInput((1,), 4, (0,), SamplingParams(temperature=0.0, logprobs=5), 0, 1)]
    assert worker.runner.fits_multi_step_graph(plain)


def test_multi_step_graph_body_equals_single_steps(worker: Worker) -> None:
    """The fused graph's body, run eagerly on the CPU (capturing needs CUDA): its tokens and
    packed logprobs, cut to the batch's top-k, are what single steps return (greedy rows here;
    test_multi_step_sampling.py mixes in random ones)."""
    runner = worker.runner
    params = [SamplingParams(temperature=0.0, logprobs=3)] * 3
    step = decode_batch(worker, params)
    step = StepInput(
        tuple(dataclasses.replace(s, token_ids=(20 + i,)) for i, s in enumerate(step.seqs)), False
    )
    single = runner.execute_single_steps(step, 4).seqs
    graphs = DecodeGraphs(
        runner.model,
        runner.inputs,
        runner.mm,
        [4],
        4,
        MAX_MODEL_LEN,
        runner.logprobs_mode,
        runner.multi_step_top_logprobs,
    )
    tokens = torch.empty(4, 4, dtype=torch.int64)
    packed = torch.empty(4, 4, packed_width(runner.multi_step_top_logprobs), dtype=torch.int32)
    with torch.inference_mode():
        graphs.load_multi_step(step, 4)
        graphs._steps(4, tokens, packed)
    entries = unpack_logprobs(trim_top(packed[:, :3], 3).reshape(12, -1).numpy())
    for row in range(3):
        assert tuple(tokens[:, row].tolist()) == single[row].token_ids
        for s, expected in enumerate(single[row].logprobs or ()):
            ours = entries[s * 3 + row]
            assert ours.token_ids == expected.token_ids and ours.ranks == expected.ranks
            np.testing.assert_allclose(ours.logprobs, expected.logprobs, atol=1e-5)
