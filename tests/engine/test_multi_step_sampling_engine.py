"""Sampled requests through the engine's fused multi-step path, on the CPU: the decode graphs are
"captured" eagerly (``dormant/worker/eager_graphs.py``), so the scheduler hands the worker
multi-step batches as it does on a GPU, and the worker replays its multi-step body for them.
A seeded generate of greedy and random (n > 1, logprobs) requests returns what an engine of
single steps returns, the fused steps really ran, and they still do after sleep/wake cycles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dormant import LLM, SamplingParams
from dormant.worker.cuda_graphs import DecodeGraphs
from dormant.worker.eager_graphs import capture_eagerly, num_replays
from dormant.worker.worker import Worker
from tests.engine.conftest import PROMPTS

STEPS = 4
Completion = tuple[tuple[int, ...], list[float]]  # a sample's tokens, its tokens' logprobs
MAX_TOKENS = 17  # one from the prefill, then 4 fused batches of 4 steps
UNTIL = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
# One per prompt: 1 + 4 + 2 sequences decode together.
PARAMS = [
    SamplingParams(temperature=0.0, logprobs=2, **UNTIL),  # type: ignore[arg-type]
    SamplingParams(n=4, temperature=1.0, seed=7, logprobs=0, **UNTIL),  # type: ignore[arg-type]
    SamplingParams(n=2, temperature=0.8, seed=9, logprobs=3, **UNTIL),  # type: ignore[arg-type]
]


@pytest.fixture
def eager_graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Workers made in the test capture their decode graphs on the CPU, eagerly, and report
    their multi-step batch size to the engine, as a GPU worker does."""
    init_kv_cache = Worker.init_kv_cache

    def init_with_graphs(self: Worker, num_blocks: int) -> int:
        init_kv_cache(self, num_blocks)
        self.runner.capture_graphs()
        graphs = self.runner.graphs
        assert graphs is not None
        return max(graphs.multi_step, default=0)

    monkeypatch.setattr(Worker, "init_kv_cache", init_with_graphs)
    monkeypatch.setattr(DecodeGraphs, "capture", capture_eagerly)
    yield


def make(checkpoint: Path, **options: object) -> LLM:
    defaults = dict(
        device="cpu", max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
    )
    return LLM(str(checkpoint), **{**defaults, **options})  # type: ignore[arg-type]


def graphs_of(llm: LLM) -> DecodeGraphs:
    graphs = llm.llm_engine.executor.worker.runner.graphs
    assert graphs is not None
    return graphs


def completions(llm: LLM, params: list[SamplingParams] = PARAMS) -> list[Completion]:
    """Each sample's tokens and its sampled tokens' logprobs, in request and sample order: one
    request per params, on the first prompts (each sample ``MAX_TOKENS`` long)."""
    result = []
    for output in llm.generate(PROMPTS[: len(params)], params):
        for sample in output.outputs:
            assert sample.logprobs is not None and len(sample.token_ids) == MAX_TOKENS
            values = [e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs, strict=True)]
            result.append((sample.token_ids, values))
    return result


def assert_same(ours: list[Completion], theirs: list[Completion]) -> None:
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("eager_graphs")
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_requests_run_fused_steps_with_single_steps_results(
    checkpoint: Path, mode: str
) -> None:
    llm = make(checkpoint, logprobs_mode=mode)
    try:
        graphs = graphs_of(llm)
        assert llm.llm_engine.scheduler.config.num_decode_steps == STEPS
        fused = completions(llm)
        num_fused = num_replays(graphs.multi_step)
        assert num_fused == (MAX_TOKENS - 1) // STEPS  # every decode: 7 rows in one replay
        assert num_replays(graphs.full) == 0
        cycles = (1, 2) if mode == "raw_logprobs" else ()  # one mode is enough for them
        for level in cycles:  # the graphs' buffers survive; the fused steps still run
            llm.sleep(level=level)
            llm.wake_up(["weights"])
            if level == 2:
                llm.reload_weights()
            llm.wake_up(["kv_cache"])
            assert_same(completions(llm), fused)
            assert num_replays(graphs.multi_step) == num_fused * (level + 1)
    finally:
        llm.shutdown()
    single = make(checkpoint, logprobs_mode=mode, cuda_graph_multi_steps=1)
    try:
        assert not graphs_of(single).multi_step
        assert_same(completions(single), fused)
        assert num_replays(graphs_of(single).full) == MAX_TOKENS - 1
    finally:
        single.shutdown()
