"""Speculative decoding inside the fused multi-step graph (issue 19), on the CPU: the rounds'
body is "captured" eagerly (``worker/eager_graphs.py``), so the scheduler hands the worker
batches of ``M`` speculative rounds as on a GPU and the worker replays the body for the greedy
ones. Greedy output equals decoding without speculation, the rounds really ran, their
acceptance counts are per round, batches the graph does not fit run as single rounds with the
same results, and a level-2 sleep and reload keep it all."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dormant import LLM, SamplingParams
from dormant.worker.eager_graphs import capture_rounds_eagerly
from dormant.worker.worker import Worker
from tests.engine.conftest import GREEDY, PROMPTS, tokens

ROUNDS = 4
OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
LOGPROBS = dataclasses.replace(GREEDY, logprobs=3, max_tokens=40)


@pytest.fixture
def eager_rounds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Workers made in the test "capture" their speculative rounds on the CPU and report the
    largest batch to the engine, as a GPU worker does."""
    init_kv_cache = Worker.init_kv_cache

    def init_with_rounds(self: Worker, num_blocks: int) -> int:
        max_rows = init_kv_cache(self, num_blocks)
        spec = self.steps.spec_step
        if spec is None or spec.rounds is None:
            return max_rows  # an engine without speculation
        capture_rounds_eagerly(spec.rounds, [1, 2, 4, 8])
        return spec.max_rounds_rows

    monkeypatch.setattr(Worker, "init_kv_cache", init_with_rounds)
    yield


@pytest.fixture
def engines() -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(checkpoint: Path, draft: Path | None = None, k: int = 3, **options: object) -> LLM:
        if draft is not None:
            spec = {"model": str(draft), "num_speculative_tokens": k}
            options = {"speculative_config": spec, **options}
        llm = LLM(str(checkpoint), **{**OPTIONS, "cuda_graph_multi_steps": ROUNDS, **options})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def replays(llm: LLM) -> int:
    rounds = llm.llm_engine.executor.worker.steps.spec_step.rounds
    return sum(graph.num_replays for graph in rounds.graphs.values())


def logprob_values(outputs: list) -> list[list[float]]:
    return [
        [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
        for o in outputs
    ]


def assert_same_logprobs(ours: list, theirs: list) -> None:
    for a, b in zip(logprob_values(ours), logprob_values(theirs), strict=True):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.usefixtures("eager_rounds")
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_rounds_equal_decoding_without_speculation(engines, checkpoint, k) -> None:
    plain = engines(checkpoint).generate(PROMPTS, LOGPROBS, use_tqdm=False)
    llm = engines(checkpoint, draft=checkpoint, k=k)
    outputs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(outputs) == tokens(plain)
    assert_same_logprobs(outputs, plain)
    assert replays(llm) > 0
    total = llm.llm_engine.spec_decode_stats
    # self-speculation: every draft of every round accepted, and each round counted alone
    assert total.num_accepted_tokens == total.num_draft_tokens == total.num_drafts * k
    assert total.num_accepted_tokens_per_pos == [total.num_drafts] * k


@pytest.mark.usefixtures("eager_rounds")
def test_a_wrong_draft_costs_tokens_per_round_not_correctness(
    engines, checkpoint, other_checkpoint
) -> None:
    plain = engines(checkpoint).generate(PROMPTS, LOGPROBS, use_tqdm=False)
    llm = engines(checkpoint, draft=other_checkpoint, k=2)
    outputs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(outputs) == tokens(plain)
    assert_same_logprobs(outputs, plain)
    assert replays(llm) > 0
    total = llm.llm_engine.spec_decode_stats
    assert total.num_accepted_tokens < total.num_draft_tokens  # an unrelated draft's


@pytest.mark.usefixtures("eager_rounds")
def test_sampled_rows_run_the_rounds_as_single_steps_with_the_same_tokens(
    engines, checkpoint
) -> None:
    """A batch with a random row does not fit the greedy graph: its rounds run one by one,
    seeded exactly as an engine that schedules one round per step."""
    params = [LOGPROBS, SamplingParams(temperature=1.0, seed=3, max_tokens=40, logprobs=1)]
    one_per_step = engines(checkpoint, draft=checkpoint, cuda_graph_multi_steps=1)
    expected = one_per_step.generate(PROMPTS[:2], params, use_tqdm=False)
    llm = engines(checkpoint, draft=checkpoint)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert tokens(outputs) == tokens(expected)
    assert_same_logprobs(outputs, expected)
    assert replays(llm) == 0
    assert llm.llm_engine.scheduler.config.num_decode_steps == ROUNDS


@pytest.mark.usefixtures("eager_rounds")
def test_rounds_after_a_level_2_sleep_and_reload_are_unchanged(engines, checkpoint) -> None:
    llm = engines(checkpoint, draft=checkpoint, enable_sleep_mode=True)
    before = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    stats = llm.llm_engine.spec_decode_stats
    rate_before, replays_before = stats.acceptance_rate, replays(llm)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    after = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(after) == tokens(before)
    assert replays(llm) > replays_before
    assert stats.acceptance_rate == rate_before == 1.0
