"""``AsyncLLM``'s errors against vLLM's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``): a request
that fails while the engine runs it raises ``EngineGenerateError`` caused by the failure, and is
aborted (``generate``'s ``except Exception``); workers that die stop the engine with
``EngineDeadError`` (``errored``, ``dead_error``); a request id already running is refused with
a typed ``ValueError`` (vLLM <= 0.12's ``OutputProcessor.add_request``: "Request id ... already
running."); and the vLLM calls dormant has no feature for (``list_loras``, ``start_profile``,
``stop_profile``) raise a typed error that says what to do, as vLLM's raise when LoRA or the
profiler is not enabled."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.core.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineGenerateError,
    UnsupportedOptionError,
)
from dormant.engine.async_llm import AsyncLLM
from dormant.engine.vllm_internals import FinishReason
from tests.engine.conftest import write_checkpoint

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
)
PROMPT = [5, 17, 99, 3, 250, 42]
HANG_S = 60


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("async_errors"), seed=1)


@pytest.fixture
def engine(model_dir: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(model_dir), enable_sleep_mode=True, **OPTIONS)
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, request_id: str, max_tokens: int = 4) -> list:
    return [o async for o in engine.generate(PROMPT, greedy(max_tokens), request_id)]


async def first_output(engine: AsyncLLM, request_id: str, max_tokens: int) -> asyncio.Task:
    """Starts a stream; returns its task once it produced an output."""
    started = asyncio.Event()

    async def run() -> list:
        outputs = []
        async for output in engine.generate(PROMPT, greedy(max_tokens), request_id):
            outputs.append(output)
            started.set()
        return outputs

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), HANG_S)
    return task


def test_a_failed_step_raises_engine_generate_error_and_the_engine_serves_on(
    engine, monkeypatch
) -> None:
    """Regression: the step's own error reached ``generate``'s caller raw (a ValueError from a
    kernel read as a bad request); vLLM raises ``EngineGenerateError`` from it. The request
    is aborted, the engine is not dead, and the next request runs."""
    fault = RuntimeError("a kernel failed")
    step = engine.engine.step
    calls = []

    def fail_once():
        calls.append(True)
        if len(calls) == 1:
            raise fault
        return step()

    monkeypatch.setattr(engine.engine, "step", fail_once)

    async def run() -> list:
        with pytest.raises(EngineGenerateError, match="'failing'") as raised:
            await collect(engine, "failing")
        assert raised.value.__cause__ is fault
        assert not engine.errored
        await engine.check_health()
        return await collect(engine, "next")

    outputs = asyncio.run(asyncio.wait_for(run(), HANG_S))
    assert outputs[-1].outputs[0].finish_reason == "length" and engine.num_requests == 0


def test_workers_dying_in_a_step_stop_the_engine_with_engine_dead_error(engine, monkeypatch):
    """Regression: a step that raised ``EngineDeadError`` (its workers gone) failed only the
    running requests; ``errored`` stayed False and ``check_health`` passed, and each later
    request was added and failed again. Now the engine is dead, as vLLM's once its core dies:
    every later call raises the same ``EngineDeadError`` at once."""
    dead = EngineDeadError("worker rank 0 died; create a new engine")

    def die():
        raise dead

    monkeypatch.setattr(engine.engine, "step", die)

    async def run() -> None:
        with pytest.raises(EngineDeadError) as raised:
            await collect(engine, "running")
        assert raised.value is dead
        assert engine.errored and engine.dead_error is dead
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine, "later")

    asyncio.run(asyncio.wait_for(run(), HANG_S))


def test_an_error_put_into_a_request_queue_raises_engine_generate_error_and_aborts_it(engine):
    """vLLM's ``OutputProcessor.propagate_error`` puts an exception into each request's
    collector; ``generate`` raises ``EngineGenerateError`` from it and aborts the request."""
    problem = ValueError("a detokenizer failed")

    async def run() -> bool:
        running = await first_output(engine, "running", 200)
        engine.output_processor.request_states["running"].queue.put(problem)
        with pytest.raises(EngineGenerateError) as raised:
            await asyncio.wait_for(running, HANG_S)
        assert raised.value.__cause__ is problem
        # Commands run in order: the abort the stream queued when it raised has run by now.
        return await engine.call(lambda: engine.engine.scheduler.has_unfinished)

    assert asyncio.run(run()) is False  # aborted, not run to 200 tokens
    assert engine.num_requests == 0


def test_a_request_id_already_running_is_refused_with_a_typed_error(engine) -> None:
    """Regression: a plain ValueError. vLLM (<= 0.12, which verl pins) raises ValueError
    "Request id ... already running."; dormant raises ``DuplicateRequestIdError``, a
    ValueError, before queuing anything: the running request is untouched."""

    async def run() -> list:
        first = await first_output(engine, "same", 24)
        with pytest.raises(DuplicateRequestIdError, match="'same' already running") as raised:
            await collect(engine, "same")
        assert isinstance(raised.value, ValueError)
        return await asyncio.wait_for(first, HANG_S)

    outputs = asyncio.run(run())
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 24


def test_vllm_calls_without_a_dormant_feature_raise_what_to_do(engine) -> None:
    """``list_loras`` (verl, with LoRA on), ``start_profile`` / ``stop_profile`` (verl's
    discrete profiler): typed errors naming the way out; verl's ``wait_for_requests_to_drain``
    and ``collective_rpc("sleep", kwargs={"level": 2})`` work."""

    async def run() -> bool:
        with pytest.raises(UnsupportedOptionError, match=r"lora\.merge=True"):
            await engine.list_loras()
        with pytest.raises(UnsupportedOptionError, match=r"start_profile: .*profiler off"):
            await engine.start_profile()
        with pytest.raises(UnsupportedOptionError, match="stop_profile"):
            await engine.stop_profile()
        await engine.wait_for_requests_to_drain()
        await engine.collective_rpc("sleep", kwargs={"level": 2})
        return await engine.is_sleeping()

    assert asyncio.run(run()) is True


def test_bad_calls_into_vllms_internals_raise_and_change_nothing(engine) -> None:
    """``make_request_output`` with tokens, a pooling output or an unknown finish reason,
    ``queue.put`` of something not an output, and a bare id string to ``abort_requests`` /
    ``abort_requests_async`` raise typed errors; the request runs on, unanswered."""

    async def run() -> list:
        running = await first_output(engine, "running", 24)
        state = engine.output_processor.request_states["running"]
        with pytest.raises(UnsupportedOptionError, match="new_token_ids"):
            state.make_request_output([7], None, FinishReason.ABORT, None)
        with pytest.raises(UnsupportedOptionError, match="pooling_output"):
            state.make_request_output([], object(), FinishReason.ABORT, None)
        with pytest.raises(UnsupportedOptionError, match="finish_reason=2"):
            state.make_request_output([], None, 2, None)
        with pytest.raises(TypeError, match="RequestOutput"):
            state.queue.put(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="list of request ids"):
            engine.output_processor.abort_requests("running")
        with pytest.raises(TypeError, match="list of request ids"):
            await engine.engine_core.abort_requests_async("running")
        assert list(engine.output_processor.request_states) == ["running"]
        return await asyncio.wait_for(running, HANG_S)

    outputs = asyncio.run(run())
    assert outputs[-1].outputs[0].finish_reason == "length"
