"""Logprobs on the GPU: the FULL decode graph and the fused multi-step graph report what the
eager path reports (bf16 tolerance), and sampling with logprobs never synchronizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dormant.core.config import EngineConfig
from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import SeqOutput, TokenLogprobs
from dormant.worker.worker import Worker
from tests.engine.conftest import PROMPTS, write_checkpoint

pytestmark = pytest.mark.gpu
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_DECODE_STEPS = 8
GREEDY = SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=5)
BF16_ATOL = 3e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("logprobs_ckpt"), seed=1)


@pytest.fixture
def make_worker(checkpoint: Path) -> Iterator[Callable[..., Worker]]:
    """Builds one worker at a time (one memory manager per device); shuts it down after."""
    made: list[Worker] = []

    def make(**options: Any) -> Worker:
        for worker in made:
            worker.shutdown()
        made.clear()
        config = EngineConfig.create(
            str(checkpoint),
            device="cuda",
            dtype="bfloat16",
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            **options,
        )
        worker = Worker(config)
        worker.load_model()
        worker.init_kv_cache(len(PROMPTS) * BLOCKS_PER_SEQ)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


def prefill(params: SamplingParams) -> StepInput:
    seqs = tuple(
        SeqInput(
            tuple(prompt),
            0,
            tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)),
            params,
            10 + i,
            0,
            compute_prompt_logprobs=params.prompt_logprobs is not None,
        )
        for i, prompt in enumerate(PROMPTS)
    )
    return StepInput(seqs, is_prefill=True)


def advance(step: StepInput, outputs: tuple[SeqOutput, ...]) -> StepInput:
    seqs = tuple(s.advanced(o.token_ids[-1]) for s, o in zip(step.seqs, outputs, strict=True))
    return StepInput(seqs, is_prefill=False)


def decode(worker: Worker, params: SamplingParams) -> list[tuple[SeqOutput, ...]]:
    """A prefill, then ``NUM_DECODE_STEPS`` single decode steps."""
    step = prefill(params)
    outputs = [worker.execute(step).seqs]
    for _ in range(NUM_DECODE_STEPS):
        step = advance(step, outputs[-1])
        outputs.append(worker.execute(step).seqs)
    return outputs


def assert_close(ours: TokenLogprobs, theirs: TokenLogprobs) -> None:
    assert ours.token_ids[0] == theirs.token_ids[0]
    torch.testing.assert_close(
        torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=BF16_ATOL, rtol=0
    )
    assert ours.ranks[0] == theirs.ranks[0]
    if len(ours.token_ids) > 1:  # logprobs=0 carries the sampled token alone
        # Near-ties may swap in bf16: the top sets agree on their best entry.
        assert ours.token_ids[1] == theirs.token_ids[1]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_full_graph_logprobs_equal_eager(make_worker, params: SamplingParams) -> None:
    graphs = decode(make_worker(), params)
    eager = decode(make_worker(enforce_eager=True), params)
    for graph_step, eager_step in zip(graphs, eager, strict=True):
        for ours, theirs in zip(graph_step, eager_step, strict=True):
            assert ours.token_ids == theirs.token_ids
            assert ours.logprobs is not None and theirs.logprobs is not None
            assert_close(ours.logprobs[0], theirs.logprobs[0])
    assert graphs[0][0].prompt_logprobs == eager[0][0].prompt_logprobs or params is SEEDED


@pytest.mark.parametrize("num_logprobs", [None, 0, 5, 21])
def test_multi_step_graph_logprobs_equal_single_steps(make_worker, num_logprobs) -> None:
    """21 is more than the graph carries (20): the batch runs as single steps."""
    worker = make_worker(cuda_graph_multi_steps=4)
    params = SamplingParams(temperature=0.0, logprobs=num_logprobs)
    first = prefill(params)
    decode_step = advance(first, worker.execute(first).seqs)
    assert worker.runner.fits_multi_step_graph(decode_step.seqs) == (num_logprobs != 21)
    fused = worker.execute_multi_step(decode_step).seqs
    single = worker.runner.execute_single_steps(decode_step, 4).seqs
    for ours, theirs in zip(fused, single, strict=True):
        assert ours.token_ids == theirs.token_ids and len(ours.token_ids) == 4
        if num_logprobs is None:
            assert ours.logprobs is None and theirs.logprobs is None
            continue
        assert ours.logprobs is not None and theirs.logprobs is not None
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert len(a.token_ids) == len(b.token_ids) == 1 + num_logprobs
            assert_close(a, b)
            assert a.ranks[0] == 1  # greedy: the sampled token is the best


def test_sampling_with_logprobs_and_penalties_never_syncs(make_worker) -> None:
    worker = make_worker(enforce_eager=True)
    runner = worker.runner
    params = SamplingParams(
        temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
        seed=1, logprobs=5,
    )  # fmt: skip
    seqs = tuple(
        SeqInput(
            (3,),
            9,
            (i,),
            params,
            i,
            2,
            output_token_ids=(3, 4),
            prompt_token_ids=(1, 2),
            masked_stop_token_ids=(7,),
            bad_words_token_ids=((4, 9), (11,)),
        )
        for i in range(4)
    )
    logits = torch.randn(4, worker.model.config.vocab_size, device="cuda")
    runner.logprobs_mode = "processed_logprobs"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            tokens, packed = runner.sampler.sample(logits, seqs)
            assert packed is not None
            pending = runner._start_copy([tokens, packed], seqs, 1, packed, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    output = pending.result()
    assert len(output.seqs) == 4 and all(s.logprobs is not None for s in output.seqs)
    assert all(s.token_ids[0] not in (7, 9, 11) for s in output.seqs)
