"""Chunked prefill changes when positions are computed, never what is generated: tokens,
logprobs, ``n`` samples and prompt logprobs equal an engine that prefills whole prompts, with
and without prefix caching; the workers really see mixed steps (decode rows beside chunks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.core.step_input import StepInput

pytestmark = pytest.mark.parametrize("device", ["cpu"])
PROMPTS = [[(5 * p + 3 * i) % 450 + 2 for i in range(n)] for p, n in enumerate((37, 3, 21, 9))]
SEEDED = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=9, ignore_eos=True, logprobs=1)


def outputs(llm, params: SamplingParams, prompts=PROMPTS) -> tuple[list, list]:
    results = llm.generate(prompts, params, use_tqdm=False)
    samples = [[tuple(c.token_ids) for c in o.outputs] for o in results]
    values = [
        [lp[t].logprob for c in o.outputs for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        for o in results
    ]
    return samples, values


def record_steps(llm) -> list[StepInput]:
    executor, seen = llm.llm_engine.executor, []
    launch = executor.launch  # every call the engine makes (UniprocExecutor)

    def recording(step: StepInput, multi_step: bool = False):  # type: ignore[no-untyped-def]
        seen.append(step)
        return launch(step, multi_step)

    executor.launch = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_chunked_outputs_equal_whole_prefills(make_llm, checkpoint: Path, prefix_caching: bool):
    whole = make_llm(str(checkpoint), enable_chunked_prefill=False, block_size=4)
    expected, expected_values = outputs(whole, SEEDED)
    chunked = make_llm(
        str(checkpoint), block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=8,
        enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    steps = record_steps(chunked)
    got, values = outputs(chunked, SEEDED)
    assert got == expected
    for row, want in zip(values, expected_values, strict=True):
        assert row == pytest.approx(want, abs=1e-4)
    assert max(step.num_tokens for step in steps) <= 8
    mixed = [
        step
        for step in steps
        if {len(s.token_ids) == 1 for s in step.seqs} == {True, False}
        and any(s.start_position > 0 and len(s.token_ids) == 1 for s in step.seqs)
    ]
    assert mixed, "no step held decodes and prompt chunks together"


def test_greedy_and_prompt_logprobs_with_chunks(make_llm, checkpoint: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    prompts = [PROMPTS[0][:14], PROMPTS[1], PROMPTS[2][:16]]
    whole = make_llm(str(checkpoint), enable_chunked_prefill=False)
    chunked = make_llm(str(checkpoint), enable_chunked_prefill=True, max_num_batched_tokens=16)
    want = whole.generate(prompts, params, use_tqdm=False)
    got = chunked.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys()
            assert [v.logprob for v in x.values()] == pytest.approx(
                [v.logprob for v in y.values()], abs=1e-4
            )
