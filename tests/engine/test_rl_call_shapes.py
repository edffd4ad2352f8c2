"""The shapes of vLLM calls that verl and NeMo-RL make on their rollout paths, where dormant
once lacked them or behaved differently (found writing tests/frameworks/test_verl_calls.py and
test_nemo_rl_calls.py). Each test fails without its fix."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from dormant import SamplingParams
from dormant.core.errors import EngineAsleepError, UnsupportedOptionError
from dormant.engine.async_llm import AsyncLLM
from dormant.vllm_compat import TokensPrompt
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, tokens, worker_of

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
)


@pytest.mark.parametrize("level", [1, 2])
def test_a_write_through_the_model_object_while_asleep_is_refused(
    make_llm, checkpoint, level: int
) -> None:
    """A worker extension's ``self.model_runner.model.load_weights(...)`` (verl, NeMo-RL, TRL)
    before ``wake_up(["weights"])``: a typed error and nothing changes (it was a segfault on
    the host backend, an illegal address on the GPU)."""
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    llm.sleep(level=level)
    before = worker_of(llm).sleep_state()
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    with pytest.raises(EngineAsleepError, match="wake_up"):
        model.load_weights(list(hf_state_dict(2).items()))
    assert worker_of(llm).sleep_state() == before  # nothing marked stale or written
    llm.wake_up(["weights"])
    model.load_weights(list(hf_state_dict(2).items()))  # awake: the same call writes
    assert worker_of(llm).sleep_state().stale_weights == frozenset()


def test_a_random_init_through_the_model_object_while_asleep_is_refused(
    make_llm, checkpoint
) -> None:
    """``model.init_random_weights(seed)`` (what ``load_format="dummy"`` runs) into weights
    discarded by ``sleep(2)``: a typed error and nothing changes, as for ``load_weights``."""
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    llm.sleep(level=2)
    before = worker_of(llm).sleep_state()
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    with pytest.raises(EngineAsleepError, match="wake_up"):
        model.init_random_weights(3)
    assert worker_of(llm).sleep_state() == before
    llm.wake_up(["weights"])
    model.init_random_weights(3)  # awake: every weight written
    assert worker_of(llm).sleep_state().stale_weights == frozenset()


@pytest.fixture
def async_engine(checkpoint) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(checkpoint), enable_sleep_mode=True, **OPTIONS)
    yield engine
    engine.shutdown()


def test_generate_takes_verls_arguments(async_engine) -> None:
    """verl's vllm_async_server.py L490 and L504-510: a ``TokensPrompt`` with an empty
    ``multi_modal_data`` and ``generate(..., lora_request=None, priority=0)`` (a TypeError and
    a ValueError before)."""

    async def run(**extra: Any) -> list[int]:
        prompt = TokensPrompt(prompt_token_ids=PROMPTS[0], multi_modal_data={})
        stream = async_engine.generate(
            prompt=prompt, sampling_params=GREEDY, request_id="r", **extra
        )
        outputs = [o async for o in stream]
        return list(outputs[-1].outputs[0].token_ids)

    expected = tokens(async_engine.llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False))[0]
    assert asyncio.run(run(lora_request=None, priority=0)) == list(expected)
    for bad in (dict(lora_request=object()), dict(priority=1)):
        with pytest.raises(UnsupportedOptionError):
            asyncio.run(run(**bad))
    image = TokensPrompt(prompt_token_ids=PROMPTS[0], multi_modal_data={"image": [object()]})
    with pytest.raises(UnsupportedOptionError, match="text-only"):
        async_engine.llm.generate(image, GREEDY, use_tqdm=False)
    assert not async_engine.engine.has_unfinished_requests()  # the refusals queued nothing


def test_collective_rpc_has_vllms_async_signature(async_engine) -> None:
    """vLLM's ``AsyncLLM.collective_rpc(method, timeout=None, args=(), kwargs=None)``: verl's
    L190-195 passes all four by name; ``timeout`` is the second positional parameter."""

    async def run() -> tuple[list[Any], list[Any], list[Any]]:
        by_name = await async_engine.collective_rpc(
            method="check_health", timeout=None, args=(), kwargs=None
        )
        positional = await async_engine.collective_rpc("check_health", 30.0)
        sleep = await async_engine.collective_rpc("sleep", kwargs={"level": 2})
        return by_name, positional, sleep

    by_name, positional, (state,) = asyncio.run(run())
    assert by_name == positional == [True]
    assert set(state.asleep_tags) >= {"weights", "kv_cache"}


def test_reset_mm_cache_and_wait_for_requests_to_drain(async_engine) -> None:
    """verl calls ``reset_mm_cache()`` once the engine is up (L407) and
    ``wait_for_requests_to_drain()`` before every sleep (L794): it returns once the running
    request finished, and times out while a kept request cannot run."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    async def run() -> tuple[bool, Any, bool]:
        await async_engine.reset_mm_cache()
        started = asyncio.Event()
        task = asyncio.create_task(_final(async_engine, PROMPTS[1], params, started))
        await started.wait()  # in flight
        await async_engine.wait_for_requests_to_drain(drain_timeout=60)
        is_busy = await async_engine.call(async_engine.engine.has_unfinished_requests)
        final = await task
        await async_engine.pause_generation(mode="keep")
        kept = asyncio.create_task(_final(async_engine, PROMPTS[2], params, asyncio.Event()))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await async_engine.wait_for_requests_to_drain(drain_timeout=0.05)
        await async_engine.resume_generation()
        await async_engine.wait_for_requests_to_drain(drain_timeout=60)
        return is_busy, final, len((await kept).outputs[0].token_ids) == 32

    is_busy, final, kept_finished = asyncio.run(run())
    assert not is_busy and kept_finished
    assert final.finished and len(final.outputs[0].token_ids) == 32


async def _final(
    engine: AsyncLLM, prompt: list[int], params: SamplingParams, started: asyncio.Event
) -> Any:
    outputs = []
    async for output in engine.generate(prompt, params, f"r{len(prompt)}"):
        outputs.append(output)
        started.set()
    return outputs[-1]


def test_hf_overrides_empty_is_accepted_anything_else_refused(checkpoint) -> None:
    """verl passes ``hf_overrides={}`` with every engine (vas L252-289): a TypeError before."""
    from dormant.core.config import EngineConfig

    for empty in ({}, None):
        assert EngineConfig.create(str(checkpoint), device="cpu", hf_overrides=empty)
    with pytest.raises(UnsupportedOptionError, match=r"config\.json"):
        EngineConfig.create(str(checkpoint), device="cpu", hf_overrides={"num_hidden_layers": 1})


def test_the_engine_object_has_reset_prefix_cache(make_llm, checkpoint) -> None:
    """NeMo-RL calls ``llm.llm_engine.reset_prefix_cache()`` before every sleep (vllm_worker.py
    L1282, L1298): an AttributeError before."""
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    assert llm.llm_engine.reset_prefix_cache() is True
    llm.sleep(level=1)
