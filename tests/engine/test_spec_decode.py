"""Speculative decoding with a draft model (issue 19), on the CPU: greedy output identical to
decoding without it (k = 1, 3, 5; self-speculation and an unrelated draft), the target's
logprobs, the acceptance counts per request and overall, and how rows that cannot draft mix
with rows that do."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dormant import LLM, SamplingParams
from tests.engine.conftest import GREEDY, PROMPTS, SEEDED, tokens

OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
LOGPROBS = dataclasses.replace(GREEDY, logprobs=3)
SHORT = dataclasses.replace(LOGPROBS, max_tokens=10)  # a draft that is always wrong: 1 per step


@pytest.fixture(scope="module")
def baseline(checkpoint: Path) -> dict[str, list]:
    """Outputs without speculation, computed once."""
    llm = LLM(str(checkpoint), **OPTIONS)
    try:
        return {
            "greedy": llm.generate(PROMPTS, LOGPROBS, use_tqdm=False),
            "short": llm.generate(PROMPTS, SHORT, use_tqdm=False),
            "mixed": llm.generate(PROMPTS, _mixed_params(), use_tqdm=False),
        }
    finally:
        llm.shutdown()


@pytest.fixture
def spec_llm(checkpoint: Path) -> Callable[..., LLM]:
    engines: list[LLM] = []

    def make(draft: Path | None = None, k: int = 3, **options: object) -> LLM:
        spec = {"model": str(draft or checkpoint), "num_speculative_tokens": k}
        options = {**OPTIONS, "speculative_config": spec, **options}
        llm = LLM(str(checkpoint), **options)
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        llm.shutdown()


def _mixed_params() -> list[SamplingParams]:
    """A row that drafts, one whose penalty keeps it from drafting, one held by min_tokens."""
    return [
        GREEDY,
        dataclasses.replace(GREEDY, repetition_penalty=1.3),
        dataclasses.replace(GREEDY, min_tokens=10, max_tokens=13),
    ]


def _same_logprobs(outputs: list, reference: list) -> bool:
    for output, ref in zip(outputs, reference, strict=True):
        for got, want in zip(output.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            if set(got) != set(want):
                return False
            if any(abs(got[t].logprob - want[t].logprob) > 1e-4 for t in want):
                return False
    return True


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_speculation_is_exact_and_accepts_every_draft(spec_llm, baseline, k: int) -> None:
    llm = spec_llm(k=k)
    outputs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(outputs) == tokens(baseline["greedy"])
    assert _same_logprobs(outputs, baseline["greedy"])
    total = llm.llm_engine.spec_decode_stats
    assert total is not None and total.num_drafts > 0
    assert total.num_accepted_tokens == total.num_draft_tokens  # 100 %
    assert total.acceptance_rate == 1.0
    per_request = [o.outputs[0].spec_decode_stats for o in outputs]
    assert sum(s.num_draft_tokens for s in per_request) == total.num_draft_tokens
    # drafts never run past max_tokens: 23 tokens after the first, up to k + 1 per step while
    # 2 or more are left
    assert all(s.num_drafts == -(-22 // (k + 1)) for s in per_request)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_an_unrelated_draft_changes_nothing_but_the_acceptance(
    spec_llm, baseline, other_checkpoint: Path, k: int
) -> None:
    llm = spec_llm(other_checkpoint, k=k)
    outputs = llm.generate(PROMPTS, SHORT, use_tqdm=False)
    assert tokens(outputs) == tokens(baseline["short"])
    assert _same_logprobs(outputs, baseline["short"])
    total = llm.llm_engine.spec_decode_stats
    assert total is not None and total.num_draft_tokens > 0
    assert total.acceptance_rate is not None and total.acceptance_rate < 0.5


def test_rows_that_cannot_draft_decode_as_without_speculation(spec_llm, baseline) -> None:
    outputs = spec_llm(k=3).generate(PROMPTS, _mixed_params(), use_tqdm=False)
    assert tokens(outputs) == tokens(baseline["mixed"])
    drafting, penalised, held = (o.outputs[0].spec_decode_stats for o in outputs)
    assert drafting is not None and drafting.num_drafts > 0
    assert penalised is None  # a logits processor: never drafts
    # min_tokens=10: no drafts before 10 outputs, then one step of 2 drafts for the last 3
    assert held is not None and (held.num_drafts, held.num_draft_tokens) == (1, 2)


@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_exact_with_prefix_hits_and_either_scheduler(
    spec_llm, baseline, chunked: bool
) -> None:
    llm = spec_llm(k=3, enable_chunked_prefill=chunked, block_size=4)
    first = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    again = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)  # prompts found in the cache
    assert tokens(first) == tokens(again) == tokens(baseline["greedy"])
    assert any(o.num_cached_tokens for o in again)
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens


def test_seeded_sampling_is_reproducible_and_self_drafts_are_accepted(
    checkpoint: Path, spec_llm
) -> None:
    spec = {"model": str(checkpoint), "num_speculative_tokens": 3}
    probabilistic = spec_llm(
        k=3, speculative_config={**spec, "draft_sample_method": "probabilistic"}
    )
    seeded = dataclasses.replace(SEEDED, max_tokens=12)
    first = probabilistic.generate(PROMPTS, seeded, use_tqdm=False)
    assert tokens(first) == tokens(probabilistic.generate(PROMPTS, seeded, use_tqdm=False))
    stats = probabilistic.llm_engine.spec_decode_stats
    # the draft's distribution is the target's: rejection sampling accepts every draft
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens
    greedy_drafts = spec_llm(k=3)  # argmax drafts of random rows: accepted with p(argmax)
    greedy_drafts.generate(PROMPTS, seeded, use_tqdm=False)
    stats = greedy_drafts.llm_engine.spec_decode_stats
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_padded_draft_passes_change_nothing(spec_llm, baseline) -> None:
    """The draft's one-token passes padded up to a graph's batch size (as on a GPU): the dummy
    rows write only the null block, so outputs and acceptance are as without padding. The
    "graph" here replays the same body eagerly."""
    llm = spec_llm(k=3)
    decoder = llm.llm_engine.executor.worker.steps.spec_step.decoder
    graphs, size = decoder.graphs, 8

    class Replay:
        def __init__(self) -> None:
            self.output = torch.empty(0)

        def replay(self) -> None:
            self.output = graphs._forward(size)

    replay = Replay()

    class Captured:
        graph = replay

        @property
        def output(self) -> torch.Tensor:
            return replay.output

    graphs.batch_sizes, graphs.full = [size], {size: Captured()}
    decoder.is_captured = True
    outputs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(outputs) == tokens(baseline["greedy"])
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens


def test_the_padded_verification_pass_pads_to_graph_sizes(spec_llm, baseline) -> None:
    """Steps whose rows all draft verify through the static pass (every row K + 1 positions),
    padded up to a graph's batch size with rows in the null block, as on a GPU (the "graph"
    replays the same body eagerly): outputs and acceptance as without it."""
    llm = spec_llm(k=3)
    verifier = llm.llm_engine.executor.worker.steps.spec_step.verifier
    size, calls = 8, []
    output = torch.empty((size * verifier.width, llm.llm_engine.config.model_config.vocab_size))

    class Graph:
        def replay(self) -> None:
            calls.append(size)
            output.copy_(verifier._forward(size))

    verifier.graphs = {size: (Graph(), output)}
    outputs = llm.generate(PROMPTS, LOGPROBS, use_tqdm=False)
    assert tokens(outputs) == tokens(baseline["greedy"])
    assert _same_logprobs(outputs, baseline["greedy"])
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens
    assert len(calls) >= 4  # the decode steps of the three prompts, together
