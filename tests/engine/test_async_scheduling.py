"""Async scheduling (``EngineConfig.async_scheduling``) on the CPU: the engine queues the next
decode call before it reads the one in flight (``engine/successor.py``), and every request's
tokens are those of synchronous steps, whether rows stop on a token, finish by length, are
aborted, or fail; commands between steps drain the call in flight first. Logprobs agree to
float rounding: a row that stopped rides along in the call queued after it, and a batch of
other rows computes other float bits, as any change of batch does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dormant import LLM, SamplingParams
from dormant.core.config import EngineConfig
from dormant.core.errors import UnsupportedOptionError
from dormant.core.step_input import StepInput
from dormant.models import ModelConfig
from tests.engine.conftest import PROMPTS, hf_config, hf_state_dict
from tests.engine.test_multi_step_sampling_engine import PARAMS as MULTI_STEP_PARAMS
from tests.engine.test_multi_step_sampling_engine import eager_graphs, make

__all__ = ["eager_graphs"]  # a fixture used by name

TARGET = ModelConfig.from_dict(hf_config().to_dict())
Completions = list[list[tuple[tuple[int, ...], list[float] | None]]]


def launches(llm: LLM) -> list[StepInput]:
    """Records the step of every call the engine launches."""
    executor, seen = llm.llm_engine.executor, []
    launch = executor.launch

    def recording(step: StepInput, multi_step: bool = False) -> Any:
        seen.append(step)
        return launch(step, multi_step)

    executor.launch = recording  # type: ignore[method-assign]
    return seen


def successors(steps: list[StepInput]) -> int:
    return sum(step.previous_rows is not None for step in steps)


def completions(llm: LLM, params: list[SamplingParams] | SamplingParams) -> Completions:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, sampled_logprobs(c)) for c in out.outputs] for out in outputs]


def sampled_logprobs(completion: Any) -> list[float] | None:
    if completion.logprobs is None:
        return None
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    return [entry[token].logprob for entry, token in pairs]


def assert_same(got: Completions, expected: Completions) -> None:
    """Tokens equal; logprobs equal to float rounding (see the module docstring)."""
    assert [[c[0] for c in out] for out in got] == [[c[0] for c in out] for out in expected]
    for out, want in zip(got, expected, strict=True):
        for (_, values), (_, wanted) in zip(out, want, strict=True):
            assert values == (None if wanted is None else pytest.approx(wanted, abs=1e-4))


def stopping_params(llm: LLM) -> list[SamplingParams]:
    """Greedy requests that stop mid-generation on a token they sample (found by a first run),
    and requests of different lengths, so rows leave while their successors are in flight."""
    first = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    stop = first[0].outputs[0].token_ids[5]
    return [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=3, logprobs=1),
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=11, logprobs=0),
    ]


CASES: dict[str, Callable[[LLM], list[SamplingParams] | SamplingParams]] = {
    "greedy": lambda _: SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    "seeded-n4-logprobs": lambda _: SamplingParams(
        n=4, temperature=0.9, top_k=40, seed=3, max_tokens=12, logprobs=2, ignore_eos=True
    ),
    "stops-and-lengths": stopping_params,
    "min-tokens": lambda _: SamplingParams(
        temperature=1.0, seed=1, max_tokens=10, min_tokens=6, stop_token_ids=[1, 2, 3]
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_async_steps_return_the_tokens_of_synchronous_steps(
    make_llm, checkpoint: Path, case: str
) -> None:
    sync = make_llm(str(checkpoint), async_scheduling=False)
    assert not sync.llm_engine.async_scheduling
    params = CASES[case](sync)
    sync_steps = launches(sync)
    expected = completions(sync, params)
    overlapped = make_llm(str(checkpoint))  # None: on, as in vLLM
    assert overlapped.llm_engine.async_scheduling
    steps = launches(overlapped)
    assert_same(completions(overlapped, params), expected)
    assert successors(sync_steps) == 0
    assert successors(steps) > 0  # calls really were queued ahead of their tokens
    assert not overlapped.llm_engine.has_unfinished_requests()


def test_calls_are_queued_ahead_while_requests_wait_for_a_slot(make_llm, checkpoint) -> None:
    """More sequences than ``max_num_seqs``: the full batch decodes ahead while the others
    wait; each starts when a slot frees, with the tokens of synchronous steps."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 9, 7)]
    sync = make_llm(str(checkpoint), async_scheduling=False, max_num_seqs=2)
    expected = completions(sync, params)
    llm = make_llm(str(checkpoint), max_num_seqs=2)
    steps = launches(llm)
    assert_same(completions(llm, params), expected)
    third = next(i for i, step in enumerate(steps) if i and step.is_prefill)  # its prefill
    assert successors(steps[:third]) >= 2  # queued ahead while it waited


def test_multi_step_graph_successors_return_the_tokens_of_synchronous_steps(
    eager_graphs: None, checkpoint: Path
) -> None:
    """The fused multi-step graph's successors take their first tokens from the graph's own
    output on the device (``InputBuffers`` gathers them)."""
    sync = make(checkpoint, async_scheduling=False)
    expected = completions(sync, MULTI_STEP_PARAMS)
    sync.shutdown()
    overlapped = make(checkpoint)
    steps = launches(overlapped)
    assert_same(completions(overlapped, MULTI_STEP_PARAMS), expected)
    assert successors(steps) >= 2  # 4-step calls, queued ahead
    overlapped.shutdown()


def test_rows_that_need_their_outputs_are_not_launched_ahead(make_llm, checkpoint: Path) -> None:
    penalised = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3)
    expected = completions(make_llm(str(checkpoint), async_scheduling=False), penalised)
    llm = make_llm(str(checkpoint))
    steps = launches(llm)
    assert_same(completions(llm, penalised), expected)
    assert successors(steps) == 0


def test_a_command_between_steps_drains_the_call_in_flight(make_llm, checkpoint: Path) -> None:
    """A step leaves the next call in flight; a sleep then completes it before its command
    reaches the workers, and returns the requests it finished with the ones it aborted."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = completions(make_llm(str(checkpoint), async_scheduling=False), params)
    llm = make_llm(str(checkpoint))
    engine = llm.llm_engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))  # in the drain
    engine.add_request(PROMPTS[1], params)
    engine.step()  # the prefill (a successor follows decodes only)
    engine.step()  # the first decode, and the second queued behind it
    assert engine.num_calls_in_flight == 1
    finished = engine.sleep(level=1)  # drains, then aborts the rest
    assert engine.num_calls_in_flight == 0
    assert sorted(o.outputs[0].finish_reason for o in finished) == ["abort", "length"]
    assert not engine.has_unfinished_requests()
    llm.wake_up()
    assert_same(completions(llm, params), expected)


def test_reading_the_memory_status_between_steps_keeps_the_call_in_flight(
    make_llm, checkpoint: Path
) -> None:
    """A ``/metrics`` scrape (``memory_status``) reads bookkeeping only: no drain; a command
    that reaches the device (``verify_guards``) drains."""
    llm = make_llm(str(checkpoint))
    engine = llm.llm_engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.num_calls_in_flight == 1
    assert llm.memory_status()[0].prefix_cache is not None
    assert engine.num_calls_in_flight == 1
    llm.collective_rpc("verify_guards")
    assert engine.num_calls_in_flight == 0


def test_a_refit_between_steps_tags_the_drained_tokens_with_the_old_weights(
    make_llm, checkpoint: Path
) -> None:
    llm = make_llm(str(checkpoint))
    engine = llm.llm_engine
    before = engine.refits.weight_version
    # Long enough for tokens after the drain where a call is a fused 4-step graph (on a GPU).
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a decode, the next queued behind it
    assert engine.num_calls_in_flight == 1
    llm.update_weights(hf_state_dict(2), weight_version="v2")  # drains first
    assert engine.num_calls_in_flight == 0 and engine.has_unfinished_requests()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = outputs
    assert len(output.outputs[0].token_ids) == 16
    # The drained call's tokens were applied before the refit: tagged with the old weights.
    assert output.weight_versions == [before, "v2"]
    assert before != "v2"


def test_a_failed_call_ahead_recomputes_and_loses_nothing(make_llm, checkpoint: Path) -> None:
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=10, ignore_eos=True)
    expected = completions(make_llm(str(checkpoint), async_scheduling=False), params)
    llm = make_llm(str(checkpoint))
    executor, calls = llm.llm_engine.executor, []
    launch = executor.launch

    def failing(step: StepInput, multi_step: bool = False) -> Any:
        calls.append(step)
        if step.previous_rows is not None and len(calls) < 4:
            raise RuntimeError("injected failure of a call queued ahead")
        return launch(step, multi_step)

    executor.launch = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.num_calls_in_flight == 0  # both calls discarded, the one in flight with it
    assert not engine.has_unfinished_requests()  # generate aborted its requests
    assert_same(completions(llm, params), expected)


def test_async_scheduling_true_is_refused_where_it_cannot_overlap() -> None:
    torchrun = dict(distributed_executor_backend="external_launcher")
    with pytest.raises(UnsupportedOptionError, match="async_scheduling=True"):
        EngineConfig.create(TARGET, async_scheduling=True, **torchrun)  # type: ignore[arg-type]
    assert not EngineConfig.create(TARGET, **torchrun).overlaps_steps  # type: ignore[arg-type]
    assert not EngineConfig.create(TARGET, async_scheduling=False).overlaps_steps
    assert EngineConfig.create(TARGET).overlaps_steps
    assert not EngineConfig.create(TARGET, tensor_parallel_size=2).overlaps_steps  # "mp": asked
    assert EngineConfig.create(TARGET, tensor_parallel_size=2, async_scheduling=True).overlaps_steps


def test_overlap_cannot_be_turned_on_for_calls_that_run_to_their_results() -> None:
    """An executor without ``launch`` (Ray actors, ``torchrun`` ranks) runs each call to its
    results: asking it to overlap raises and leaves it synchronous."""
    from dormant.engine.calls_in_flight import CallsInFlight

    class Synchronous:  # the Executor protocol, without launch
        world_size = 1

    calls = CallsInFlight(Synchronous(), overlaps=True)  # type: ignore[arg-type]
    assert not calls.overlaps
    with pytest.raises(ValueError, match="cannot overlap"):
        calls.overlaps = True
    assert not calls.overlaps
