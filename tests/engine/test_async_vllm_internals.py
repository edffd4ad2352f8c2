"""vLLM's ``AsyncLLM`` internals as dormant answers them (``vllm_internals.py``), against vLLM's
``vllm/v1/engine/output_processor.py``: ``get_num_unfinished_requests()`` is
``len(request_states)``, so a request stops counting at ``output_processor.abort_requests``
(the engine may run it until ``engine_core.abort_requests_async``) and counts from
``generate`` on; and a FINAL_ONLY request aborted through ``make_request_output`` carries the
tokens, text and logprobs generated so far, without the loop building its output per step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dormant import SamplingParams
from dormant.core.sampling_params import RequestOutputKind
from dormant.engine.async_llm import AsyncLLM
from dormant.engine.vllm_internals import FinishReason
from tests.engine.conftest import write_checkpoint
from tests.server.tokenizer_files import write_tokenizer

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
)
PROMPT = [5, 17, 99, 3, 250, 42]
HANG_S = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("async_vllm_internals"), seed=1)
    write_tokenizer(path)
    return path


@pytest.fixture
def engine(model_dir: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(model_dir), **OPTIONS)
    yield engine
    engine.shutdown()


def params(max_tokens: int = 200, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )


async def collect(engine: AsyncLLM, request_id: str, sampling: SamplingParams, kind=None):
    stream = engine.generate(PROMPT, sampling, request_id, output_kind=kind)
    return [output async for output in stream]


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)


def num_tokens(engine: AsyncLLM, request_id: str) -> int:
    state = engine.output_processor.request_states.get(request_id)
    output = None if state is None else state.make_request_output([], None, None, None)
    return 0 if output is None else len(output.outputs[0].token_ids)


def test_a_request_stops_counting_once_the_output_processor_aborts_it(engine) -> None:
    """Regression: ``get_num_unfinished_requests()`` counted a request between
    ``output_processor.abort_requests`` and the engine's abort (verl's order; OpenRLHF then
    balances prompts by the count). vLLM pops it from ``request_states`` there. A request whose
    add is still queued counts, as vLLM's counts once ``generate`` registered it."""
    release = threading.Event()

    async def run() -> list[Any]:
        running = asyncio.create_task(collect(engine, "r", params()))
        await until(lambda: num_tokens(engine, "r") > 0)
        processor = engine.output_processor
        counts = [processor.get_num_unfinished_requests()]
        assert processor.abort_requests(["r"]) == ["r"]
        counts += [processor.get_num_unfinished_requests(), processor.has_unfinished_requests()]
        counts.append(engine.num_requests)  # the engine still runs it
        await asyncio.wait_for(running, HANG_S)
        await engine.engine_core.abort_requests_async(["r"])
        counts.append(engine.num_requests)
        engine._engine_loop.submit(release.wait)  # the next add waits behind this
        queued = asyncio.create_task(collect(engine, "q", params(3)))
        await until(lambda: "q" in engine._requests._pending)
        counts.append(processor.get_num_unfinished_requests())
        release.set()
        await asyncio.wait_for(queued, HANG_S)
        counts.append(processor.get_num_unfinished_requests())
        return counts

    try:
        counts = asyncio.run(asyncio.wait_for(run(), HANG_S))
    finally:
        release.set()
    assert counts == [1, 0, False, 1, 0, 1, 0]


def test_a_final_only_request_aborted_carries_what_it_generated_so_far(engine) -> None:
    """Regression: a FINAL_ONLY request aborted through ``make_request_output`` (verl's abort
    path) ended with its prompt and no tokens; vLLM's carries the tokens, text and logprobs so
    far (``RequestState._new_completion_output``). They are the greedy run's prefix, and the
    loop built the request's output only when it was added and when it was aborted."""
    built: list[Any] = []
    request_output = engine.engine.request_output

    def counting(request_id: Any) -> Any:
        built.append(request_id)
        return request_output(request_id)

    engine.engine.request_output = counting  # type: ignore[method-assign]

    async def run() -> tuple[Any, Any, Any]:
        sampling = params(logprobs=1)
        pacer = asyncio.create_task(collect(engine, "pacer", params()))
        final_only = asyncio.create_task(
            collect(engine, "final", sampling, RequestOutputKind.FINAL_ONLY)
        )
        await until(lambda: num_tokens(engine, "pacer") > 8)  # "final" ran every step since
        final_id = engine._requests._user_ids["final"]
        state = engine.output_processor.request_states["final"]
        assert state.make_request_output([], None, None, None) is None  # as vLLM's
        state.queue.put(state.make_request_output([], None, FinishReason.ABORT, None))
        (aborted,) = await asyncio.wait_for(final_only, HANG_S)
        assert engine.output_processor.abort_requests(["final", "pacer"]) == ["final", "pacer"]
        await engine.engine_core.abort_requests_async(["final", "pacer"])
        await asyncio.wait_for(pacer, HANG_S)
        return aborted, (await collect(engine, "full", sampling))[-1], final_id

    aborted, full, final_id = asyncio.run(asyncio.wait_for(run(), HANG_S))
    got, want = aborted.outputs[0], full.outputs[0]
    assert aborted.finished and aborted.request_id == "final" and got.finish_reason == "abort"
    assert aborted.prompt_token_ids == PROMPT
    assert 4 <= len(got.token_ids) < 200 and got.token_ids == want.token_ids[: len(got.token_ids)]
    assert len(got.logprobs) == len(got.token_ids)
    for position, token in enumerate(got.token_ids):  # batches differ: values within 1e-4
        assert got.logprobs[position][token].logprob == pytest.approx(
            want.logprobs[position][token].logprob, abs=1e-4
        )
    assert got.text and want.text.startswith(got.text)
    # Built when added, then once per abort call (the put, and abort_requests): never per step.
    assert [str(b) for b in built].count(final_id) == 3
