"""The fused multi-step graph samples on the CPU as single steps do (capturing needs CUDA, so
the graph's body runs eagerly): seeded random rows beside greedy ones, token for token and
logprob for logprob, in both logprobs modes; ``execute_multi_step`` replays it (an eager
stand-in for each captured graph) for the rows it fits, and runs single steps for filtered,
penalised or masked rows; ``GraphSampling`` holds each step's rows as ``from_sequences`` builds
them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from worker_setup import MAX_MODEL_LEN, VOCAB_SIZE

from dormant.core.config import LogprobsMode
from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import SeqOutput
from dormant.worker.cuda_graphs import DecodeGraphs
from dormant.worker.eager_graphs import capture_eagerly, num_replays
from dormant.worker.graph_sampling import GraphSampling, is_unfiltered
from dormant.worker.logprobs import packed_width, trim_top, unpack_logprobs
from dormant.worker.model_runner import ModelRunner
from dormant.worker.sampler import SamplingTensors
from dormant.worker.worker import Worker

BLOCKS_PER_SEQ = 6  # 24 positions per row: the prompt and two multi-step batches fit
PROMPT = (11, 12, 13, 14, 15)
NUM_STEPS = 4
BATCH_SIZE = 8  # the graphs' one size: the batches below are padded to it
# Random rows at temperatures 0.8 and 1.0 (top-k "off" spelled each way vLLM's callers spell
# it) beside greedy ones, asking for no logprobs, the sampled token's alone, or 5 top. Each row
# draws with its SeqInput's seed (100 + row), as the engine derives it from the request's.
MIXED = [
    SamplingParams(temperature=0.8, logprobs=5),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, logprobs=0),
    SamplingParams(temperature=1.0, top_k=-1),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, logprobs=0),
    SamplingParams(temperature=1.0, top_k=VOCAB_SIZE + 5, logprobs=5),
]
FALLBACKS = {
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.1),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence_penalty": dict(presence_penalty=0.5),
    "frequency_penalty": dict(frequency_penalty=0.5),
    "bad_words": {},
    "min_tokens": dict(min_tokens=3),
}


def blocks(row: int) -> tuple[int, ...]:
    return tuple(range(row * BLOCKS_PER_SEQ, (row + 1) * BLOCKS_PER_SEQ))


def decode_step(worker: Worker, params: list[SamplingParams], **fields: object) -> StepInput:
    """Prefills one prompt per entry of ``params`` (seed 100 + row) and returns their first
    decode step."""
    seqs = tuple(
        SeqInput(PROMPT, 0, blocks(i), p, 100 + i, 0, **fields)  # type: ignore[arg-type]
        for i, p in enumerate(params)
    )
    first = worker.execute(StepInput(seqs, is_prefill=True)).seqs
    return StepInput(
        tuple(s.advanced(o.token_ids[0]) for s, o in zip(seqs, first, strict=True)), False
    )


def make_graphs(runner: ModelRunner, mode: LogprobsMode) -> DecodeGraphs:
    return DecodeGraphs(
        runner.model, runner.inputs, runner.mm, [BATCH_SIZE], NUM_STEPS, MAX_MODEL_LEN, mode,
        runner.multi_step_top_logprobs,
    )  # fmt: skip


@pytest.fixture
def eager_graphs(worker: Worker) -> Iterator[Callable[[], DecodeGraphs]]:
    """Installs ``DecodeGraphs`` of one batch size whose full and multi-step graphs run their
    bodies eagerly (``capture_eagerly``); the runner has no graphs again afterwards."""
    runner = worker.runner

    def install() -> DecodeGraphs:
        graphs = make_graphs(runner, runner.logprobs_mode)
        with torch.inference_mode():
            capture_eagerly(graphs)
        runner.graphs = graphs
        return graphs

    yield install
    runner.graphs = None


@pytest.fixture
def logprobs_mode(worker: Worker) -> Iterator[Callable[[LogprobsMode], None]]:
    previous = worker.runner.logprobs_mode

    def use(mode: LogprobsMode) -> None:
        worker.runner.logprobs_mode = mode

    yield use
    worker.runner.logprobs_mode = previous


def assert_same_outputs(ours: tuple[SeqOutput, ...], theirs: tuple[SeqOutput, ...]) -> None:
    """Tokens identical; logprobs with the same tokens and ranks, values within float32
    rounding of the model's forward at another batch shape."""
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == NUM_STEPS
        if b.logprobs is None:
            assert a.logprobs is None
            continue
        assert a.logprobs is not None and len(a.logprobs) == NUM_STEPS
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_ids == y.token_ids and x.ranks == y.ranks
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)


def num_sampled_below_the_top(outputs: tuple[SeqOutput, ...]) -> int:
    """Steps whose token is not the row's best (greedy decoding never has one)."""
    entries = [e for o in outputs for e in (o.logprobs or ())]
    return sum(e.ranks[0] > 1 for e in entries)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_graph_body_samples_what_single_steps_sample(
    worker: Worker, logprobs_mode, mode: LogprobsMode
) -> None:
    """The body, run eagerly after ``load_multi_step`` (padded to 8 rows): each row's tokens
    and packed logprobs (cut to the batch's top 5) are what single steps return."""
    runner = worker.runner
    logprobs_mode(mode)
    step = decode_step(worker, MIXED)
    single = runner.execute_single_steps(step, NUM_STEPS).seqs
    assert num_sampled_below_the_top(single) > 0  # the random rows really sampled
    graphs = make_graphs(runner, mode)
    width = packed_width(runner.multi_step_top_logprobs)
    tokens = torch.empty(NUM_STEPS, BATCH_SIZE, dtype=torch.int64)
    packed = torch.empty(NUM_STEPS, BATCH_SIZE, width, dtype=torch.int32)
    with torch.inference_mode():
        graphs.load_multi_step(step, BATCH_SIZE)
        graphs._steps(BATCH_SIZE, tokens, packed)
    num_seqs = len(MIXED)
    entries = unpack_logprobs(trim_top(packed[:, :num_seqs], 5).reshape(-1, 3 + 2 * 5).numpy())
    ours = tuple(
        SeqOutput(
            tuple(tokens[:, row].tolist()),
            None
            if MIXED[row].logprobs is None
            else tuple(entries[s * num_seqs + row] for s in range(NUM_STEPS)),
        )
        for row in range(num_seqs)
    )
    assert_same_outputs(ours, single)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_execute_multi_step_replays_the_graph_for_unfiltered_rows(
    worker: Worker, eager_graphs, logprobs_mode, mode: LogprobsMode
) -> None:
    logprobs_mode(mode)
    step = decode_step(worker, MIXED)
    single = worker.runner.execute_single_steps(step, NUM_STEPS).seqs
    graphs = eager_graphs()
    assert worker.runner.fits_multi_step_graph(step.seqs)
    fused = worker.execute_multi_step(step).seqs
    assert num_replays(graphs.multi_step) == 1
    assert num_replays(graphs.full) == 0
    assert_same_outputs(fused, single)
    assert num_sampled_below_the_top(fused) > 0
    # The next replay continues each request's draws from its new output position.
    after = step.seqs
    for k in range(NUM_STEPS):
        after = tuple(s.advanced(o.token_ids[k]) for s, o in zip(after, fused, strict=True))
    fused_next = worker.execute_multi_step(StepInput(after, False)).seqs
    worker.runner.graphs = None
    next_single = worker.runner.execute_single_steps(StepInput(after, False), NUM_STEPS).seqs
    assert_same_outputs(fused_next, next_single)


def test_a_batch_without_logprobs_returns_none(worker: Worker, eager_graphs) -> None:
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.0)]
    step = decode_step(worker, params)
    single = worker.runner.execute_single_steps(step, NUM_STEPS).seqs
    eager_graphs()
    fused = worker.execute_multi_step(step).seqs
    assert all(o.logprobs is None for o in fused)
    assert_same_outputs(fused, single)


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_filtered_penalised_or_masked_rows_run_single_steps(
    worker: Worker, eager_graphs, case: str
) -> None:
    """The first row does what the graph does not; the second alone would fit it."""
    params = [
        SamplingParams(temperature=1.0, logprobs=2, **FALLBACKS[case]),  # type: ignore[arg-type]
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    step = decode_step(worker, params, output_token_ids=(), prompt_token_ids=PROMPT)
    masks = {"bad_words": dict(bad_words_token_ids=((3,), (4, 9)))}
    masks["min_tokens"] = dict(masked_stop_token_ids=(VOCAB_SIZE - 1,))
    if case in masks:
        first = dataclasses.replace(step.seqs[0], **masks[case])  # type: ignore[arg-type]
        step = StepInput((first, step.seqs[1]), False)
    single = worker.runner.execute_single_steps(step, NUM_STEPS).seqs
    graphs = eager_graphs()
    assert not worker.runner.fits_multi_step_graph(step.seqs)
    assert worker.runner.fits_multi_step_graph(step.seqs[1:])
    fused = worker.execute_multi_step(step).seqs
    assert num_replays(graphs.multi_step) == 0
    assert num_replays(graphs.full) == NUM_STEPS
    assert_same_outputs(fused, single)


@pytest.mark.parametrize("case", ["top_k", "frequency_penalty", "min_tokens"])
def test_the_graph_fits_rows_by_each_params_object_and_row(worker: Worker, case: str) -> None:
    """Rows share params objects (a request's ``n`` samples do): the fit is decided by every
    distinct one and every row's masks, wherever a row that does not fit sits."""
    shared = SamplingParams(temperature=1.0, logprobs=0)
    odd = SamplingParams(temperature=1.0, **FALLBACKS[case])  # type: ignore[arg-type]

    def row(params: SamplingParams, seed: int) -> SeqInput:
        masks = (VOCAB_SIZE - 1,) if case == "min_tokens" and params is odd else ()
        return SeqInput((1,), 4, (0,), params, seed, 0, masked_stop_token_ids=masks)

    fits = worker.runner.fits_multi_step_graph
    assert fits([row(shared, i) for i in range(4)])
    for position in range(5):
        rows = [row(shared, i) for i in range(4)]
        rows.insert(position, row(odd, 9))
        assert not fits(rows), position
    assert not fits([row(odd, i) for i in range(3)])


def test_multi_step_refuses_prefills_and_oversized_batches(worker: Worker, eager_graphs) -> None:
    step = decode_step(worker, [SamplingParams(temperature=1.0, seed=1)])
    eager_graphs()
    with pytest.raises(ValueError, match="multi-step graphs run decode batches"):
        worker.execute_multi_step(dataclasses.replace(step, is_prefill=True))
    rows = tuple(dataclasses.replace(step.seqs[0], seed=i) for i in range(BATCH_SIZE + 1))
    with pytest.raises(ValueError, match=f"at most {BATCH_SIZE} sequences; got 9 rows"):
        worker.execute_multi_step(StepInput(rows, False))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2),  # greedy: reset
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=-1),
        SamplingParams(temperature=0.5, top_k=0),
        SamplingParams(temperature=0.5, top_k=VOCAB_SIZE),
        SamplingParams(temperature=0.5, top_k=10**30),
        SamplingParams(temperature=0.5, top_k=VOCAB_SIZE - 1),
        SamplingParams(temperature=0.5, top_p=0.999),
        SamplingParams(temperature=0.5, min_p=1e-6),
    ],
)
def test_is_unfiltered_is_what_from_sequences_does_not_filter(params: SamplingParams) -> None:
    seq = SeqInput((1,), 0, (0,), params, 0, 0)
    tensors = SamplingTensors.from_sequences([seq], VOCAB_SIZE, "cpu")
    assert is_unfiltered(params, VOCAB_SIZE) == (not tensors.is_any_filtered)


def test_graph_sampling_rows_are_each_step_s_from_sequences(worker: Worker) -> None:
    """Step j's rows of a padded batch equal ``from_sequences`` of the rows j steps later;
    padding rows are greedy at temperature 1; the views keep their addresses across loads of
    every batch size."""
    sampling = GraphSampling(worker.runner.mm, 16, NUM_STEPS, VOCAB_SIZE)
    seqs = [
        SeqInput((1,), 4, (0,), p, seed, num_out)
        for p, seed, num_out in [
            (SamplingParams(temperature=0.7), -3, 9),
            (SamplingParams(temperature=0.0), 2**63 + 5, 0),
            (SamplingParams(temperature=1.3, top_k=-1), 12345678901234567, 2**33),
        ]
    ]
    addresses = [t.data_ptr() for t in sampling.tensors()]
    sampling.load(seqs[:1], 16)  # another layout first: nothing of it may remain
    for bs in (3, 4):
        sampling.load(seqs, bs)
        rows = sampling.rows(bs)
        assert len(rows) == NUM_STEPS
        for j, ours in enumerate(rows):
            later = [
                dataclasses.replace(s, num_output_tokens=s.num_output_tokens + j) for s in seqs
            ]
            theirs = SamplingTensors.from_sequences(later, VOCAB_SIZE, "cpu")
            assert not ours.is_all_greedy and not ours.is_any_filtered
            for name in ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "steps"):
                assert torch.equal(getattr(ours, name)[:3], getattr(theirs, name)), name
            assert torch.equal(ours.is_greedy[:3], theirs.is_greedy)
            assert torch.equal(ours.noise_keys[:, :3], theirs.noise_keys)
            assert ours.noise_keys.is_contiguous() and ours.temperatures.is_contiguous()
            assert ours.is_greedy[3:].all() and (ours.temperatures[3:] == 1.0).all()
            assert all(t.shape[-1] == bs for t in (ours.temperatures, ours.noise_keys))
    assert [t.data_ptr() for t in sampling.tensors()] == addresses


def test_a_logprobs_mode_changed_after_capture_runs_single_steps(
    worker: Worker, eager_graphs, logprobs_mode
) -> None:
    """The graph reports the mode it was captured with; a batch asking for logprobs in
    another mode gets them from single steps (one without logprobs still replays)."""
    logprobs_mode("raw_logprobs")
    graphs = eager_graphs()
    logprobs_mode("processed_logprobs")
    step = decode_step(worker, MIXED)
    fused = worker.execute_multi_step(step).seqs
    assert num_replays(graphs.multi_step) == 0
    worker.runner.graphs = None
    assert_same_outputs(fused, worker.runner.execute_single_steps(step, NUM_STEPS).seqs)
    worker.runner.graphs = graphs
    unasked = SamplingParams(temperature=1.0)
    no_logprobs = StepInput(tuple(dataclasses.replace(s, params=unasked) for s in step.seqs), False)
    worker.execute_multi_step(no_logprobs)
    assert num_replays(graphs.multi_step) == 1
