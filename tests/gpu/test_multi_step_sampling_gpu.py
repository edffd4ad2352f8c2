"""The fused multi-step graph for sampled requests on the GPU: a seeded temperature-1.0 generate
with n=4 and logprobs=0 returns the same tokens and logprobs with ``cuda_graph_multi_steps=4``
as with 1; its decodes really replay the multi-step graphs (every replay of a captured graph is
counted, so a silent fall-back to single steps fails), and still do, with the same results,
after a sleep(1)/wake and a sleep(2)/refit cycle (no recapture)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.worker.cuda_graphs import DecodeGraphs
from tests.engine.conftest import write_checkpoint
from tests.engine.test_multi_step_sampling_engine import MAX_TOKENS, Completion, completions
from tests.gpu.conftest import make_engine
from tests.gpu.test_engine_graphs import cycle

pytestmark = pytest.mark.gpu
STEPS = 4
UNTIL = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(n=4, temperature=1.0, seed=7, logprobs=0, **UNTIL)  # type: ignore[arg-type]
# Greedy and processed-logprobs rows beside random ones, in one batch.
MIXED = [
    SamplingParams(temperature=0.0, logprobs=2, **UNTIL),  # type: ignore[arg-type]
    SAMPLED,
    SamplingParams(n=2, temperature=0.8, seed=9, logprobs=3, **UNTIL),  # type: ignore[arg-type]
]
# The same kernels on the same rows compute both engines' logits; the tolerance leaves room for
# a kernel's choice, and still tells processed from raw logprobs at T=0.8, or another token's.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("multi_step_sampling_ckpt"), seed=1)


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How often each CUDA graph (by id) replayed during the test."""
    counts: Counter[int] = Counter()
    replay = torch.cuda.CUDAGraph.replay

    def counted(self: torch.cuda.CUDAGraph) -> None:
        counts[id(self)] += 1
        replay(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    return counts


def graphs_of(llm: LLM) -> DecodeGraphs:
    graphs = llm.llm_engine.executor.worker.runner.graphs
    assert graphs is not None
    return graphs


def num_replays(llm: LLM, replays: Counter[int], kind: str) -> int:
    graphs = getattr(graphs_of(llm), kind)
    return sum(replays[id(captured.graph)] for captured in graphs.values())


def assert_same(ours: list[Completion], theirs: list[Completion]) -> None:
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("params", "mode"),
    [([SAMPLED] * 2, "raw_logprobs"), (MIXED, "raw_logprobs"), (MIXED, "processed_logprobs")],
    ids=["n4-t1", "mixed-raw", "mixed-processed"],
)
def test_sampled_decodes_replay_the_multi_step_graph(
    engines, checkpoint, replays, params: list[SamplingParams], mode: str
) -> None:
    llm = make_engine(engines, checkpoint, max_num_seqs=16, logprobs_mode=mode)
    assert graphs_of(llm).multi_step and llm.llm_engine.scheduler.config.num_decode_steps == STEPS
    fused = completions(llm, params)
    num_fused = num_replays(llm, replays, "multi_step")
    assert num_fused == (MAX_TOKENS - 1) // STEPS  # every decode batch, all rows in one replay
    assert num_replays(llm, replays, "full") == 0
    for level in (1, 2):
        cycle(llm, level)
        assert_same(completions(llm, params), fused)
        assert num_replays(llm, replays, "multi_step") == num_fused * (level + 1)
    llm.collective_rpc("verify_guards")
    engines.pop().shutdown()  # one engine per GPU at a time
    single = make_engine(
        engines, checkpoint, max_num_seqs=16, logprobs_mode=mode, cuda_graph_multi_steps=1
    )
    assert not graphs_of(single).multi_step
    replays.clear()  # the first engine's graphs are gone: their ids may be reused
    assert_same(completions(single, params), fused)
    assert num_replays(single, replays, "full") == MAX_TOKENS - 1
