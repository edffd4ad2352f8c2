"""Every tensor the engine keeps beyond a step lives in a tag (issue 17, residual): the census of
the worker's object graph on the host backend, where the device is the CPU. Awake after
generating and asleep at level 2, it finds nothing outside the tags but the declared host-side
staging; and it finds what breaks the rule (a buffer kept outside the tags, a host buffer that
was not declared). The GPU side is tests/gpu/test_residual.py."""

from __future__ import annotations

import pytest
import torch

from dormant import SamplingParams
from dormant.memory import WORKSPACE
from dormant.memory.census import host_staging, untagged_tensors
from tests.engine.conftest import GREEDY, PROMPTS, worker_of

pytestmark = pytest.mark.parametrize("device", ["cpu"])  # the host backend's census
PENALISED = SamplingParams(
    temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3, logprobs=2
)


def census(llm) -> list[str]:
    worker = worker_of(llm)
    return [path for path, _ in untagged_tensors(worker, worker.mm)]


def test_nothing_outlives_a_step_outside_the_tags(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    assert census(llm) == []  # after start-up
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.generate(PROMPTS, PENALISED, use_tqdm=False)  # the staging of penalties and logprobs
    assert census(llm) == []
    llm.sleep(level=2)
    assert census(llm) == []


def test_the_census_finds_what_breaks_the_rule(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    worker = worker_of(llm)
    runner = worker.runner
    runner.scratch = torch.zeros(16, device=worker.device)  # kept, in no tag
    runner.cache = {"rows": [torch.ones(4)]}  # nested: found by its path
    runner.staged = host_staging(torch.zeros(8))  # declared host staging: left out
    runner.in_a_tag = worker.mm.empty((8,), torch.float32, WORKSPACE)
    assert census(llm) == ["root._steps.runner.scratch", "root._steps.runner.cache['rows'][0]"]
