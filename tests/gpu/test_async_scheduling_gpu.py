"""Async scheduling on the GPU, through the captured graphs: a decode call queued behind the
one in flight takes its input tokens from that call's output on the device (the FULL graph's
sampled tokens, or the fused multi-step graph's last step), and every request's tokens are those
of synchronous steps, before and after a sleep/wake cycle, with the graphs' addresses kept."""

from __future__ import annotations

from typing import Any

import pytest

from dormant import LLM, SamplingParams
from dormant.core.step_input import StepInput
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.gpu.conftest import make_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_checkpoint(tmp_path_factory.mktemp("async_ckpt"), seed=1)


def launches(llm: LLM) -> list[tuple[StepInput, bool]]:
    executor, seen = llm.llm_engine.executor, []
    launch = executor.launch

    def recording(step: StepInput, multi_step: bool = False) -> Any:
        seen.append((step, multi_step))
        return launch(step, multi_step)

    executor.launch = recording  # type: ignore[method-assign]
    return seen


def run(llm: LLM, params: list[SamplingParams]) -> list[list[tuple[tuple[int, ...], list[float]]]]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, sampled_logprobs(c)) for c in out.outputs] for out in outputs]


def sampled_logprobs(completion: Any) -> list[float]:
    assert completion.logprobs is not None  # every request here asks for them
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    return [entry[token].logprob for entry, token in pairs]


def mixed(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=21, stop_token_ids=[stop_token], logprobs=0),
        SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=17, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True),
    ]


@pytest.mark.parametrize("multi_steps", [4, 1], ids=["multi-step", "full"])
def test_calls_queued_ahead_decode_what_synchronous_steps_decode(
    engines, checkpoint, multi_steps: int
) -> None:
    sync = make_engine(
        engines, checkpoint, async_scheduling=False, cuda_graph_multi_steps=multi_steps
    )
    first = sync.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    params = mixed(first[0].outputs[0].token_ids[7])  # request 0 stops mid-way
    expected = run(sync, params)
    engines.pop().shutdown()  # one engine per GPU at a time
    llm = make_engine(engines, checkpoint, cuda_graph_multi_steps=multi_steps)
    seen = launches(llm)
    for cycle in range(2):  # then again after a level-1 sleep: graphs and buffers kept
        got = run(llm, params)
        assert [[c[0] for c in o] for o in got] == [[c[0] for c in o] for o in expected]
        for out, want in zip(got, expected, strict=True):
            for (_, values), (_, wanted) in zip(out, want, strict=True):
                assert values == pytest.approx(wanted, abs=1e-3)
        ahead = [(s, m) for s, m in seen if s.previous_rows is not None]
        assert ahead, "no call was queued ahead of its tokens"
        if multi_steps > 1:
            assert any(m for _, m in ahead)  # fused graphs took their tokens on the device
        seen.clear()
        if cycle == 0:
            llm.sleep(level=1)
            llm.wake_up()
    llm.collective_rpc("verify_guards")  # the new input buffers kept their addresses
