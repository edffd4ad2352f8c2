"""verl's abort path against dormant's ``AsyncLLM``: ``vLLMHttpServer.abort_all_requests`` and
``abort_request`` reach into vLLM's internals (``output_processor.request_states``,
``RequestState.make_request_output`` / ``queue.put``, ``output_processor.abort_requests``,
``engine_core.abort_requests_async`` and ``vllm.v1.engine.FinishReason``). ``verl_server.py``
makes verl's calls in verl's order; ``FinishReason`` comes from ``install_as_vllm``'s
``vllm.v1.engine``. Steps are held by a gate, never timed: a timeout only turns a hang into a
failure.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dormant
from dormant import SamplingParams
from dormant.engine.async_llm import AsyncLLM
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.frameworks.verl_server import VerlServer, verl_generate

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0,
    enable_prefix_caching=True, enable_sleep_mode=True,
)  # fmt: skip
# verl's validation sampling (rollout.yaml L132-151), greedy; ignore_eos keeps LONG running
# until it is aborted.
LONG = dict(temperature=0, top_p=1.0, top_k=-1, logprobs=True, max_tokens=200, ignore_eos=True)
HANG_S = 60


class StepGate:
    """Once closed, the loop's next step waits (inside the step) until the gate opens."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.is_closed, self.is_open, self.in_step = (threading.Event() for _ in range(3))
        self.is_open.set()
        step = engine.engine.step

        def gated_step():
            if self.is_closed.is_set():
                self.in_step.set()
                self.is_open.wait()
            return step()

        engine.engine.step = gated_step  # type: ignore[method-assign]

    async def close(self) -> None:
        """Returns once the loop thread waits inside a step."""
        self.is_open.clear()
        self.is_closed.set()
        await asyncio.to_thread(self.in_step.wait, HANG_S)

    def open(self) -> None:
        self.is_closed.clear()
        self.is_open.set()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("verl_abort"), seed=1)


@pytest.fixture
def engine(model_dir: Path, vllm_stand_in: None) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(model_dir), **OPTIONS)
    yield engine
    engine.shutdown()


@pytest.fixture
def vllm_stand_in() -> Iterator[None]:
    """``install_as_vllm`` for one test; its modules are removed afterwards."""
    if "vllm" in sys.modules:
        pytest.skip("a vllm module is already imported in this process")
    dormant.install_as_vllm()
    yield
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


async def started(engine: AsyncLLM, sampling: dict[str, Any], request_id: str) -> asyncio.Task:
    """verl's generate for ``PROMPTS[0]``, as a task, once the request has generated a token."""
    task = asyncio.create_task(verl_generate(engine, list(PROMPTS[0]), sampling, request_id))
    await asyncio.wait_for(until(lambda: has_tokens(engine, request_id)), HANG_S)
    return task


def has_tokens(engine: AsyncLLM, request_id: str) -> bool:
    state = engine.output_processor.request_states.get(request_id)
    if state is None:
        return False
    output = state.make_request_output([], None, None, None)
    return output is not None and len(output.outputs[0].token_ids) > 0


async def until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.005)


async def engine_is_idle(engine: AsyncLLM) -> bool:
    """Nothing scheduled (a call in flight may still be read back), every KV block free,
    nothing tracked or listed; and once the engine drained, no work left at all."""
    blocks = engine.engine.scheduler.block_manager
    scheduled = await engine.call(lambda: engine.engine.scheduler.has_unfinished)
    free = await engine.call(lambda: blocks.num_free_blocks == blocks.num_blocks)
    listed = engine.num_requests or engine.output_processor.request_states
    await asyncio.wait_for(engine.wait_for_requests_to_drain(), HANG_S)
    busy = await engine.call(engine.engine.has_unfinished_requests)
    return not scheduled and free and not listed and not busy


def test_verl_abort_all_requests_ends_every_stream_with_abort(engine) -> None:
    """verl's ``abort_all_requests`` with three requests running: each stream ends with an
    output finished with "abort" as soon as verl puts it (while the engine is still held in a
    step), holding the greedy tokens generated so far with their logprobs; then the engine
    stops the requests and frees their blocks, and the next request runs as before."""
    server = VerlServer(engine)

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]], bool, dict[str, Any]]:
        gate = StepGate(engine)
        tasks = [await started(engine, LONG, f"r{i}") for i in range(3)]
        await gate.close()
        abort = asyncio.create_task(server.abort_all_requests())
        finals = await asyncio.wait_for(asyncio.gather(*tasks), HANG_S)  # the engine is held
        gate.open()
        result = await asyncio.wait_for(abort, HANG_S)
        idle = await engine_is_idle(engine)
        after = await verl_generate(engine, list(PROMPTS[0]), dict(LONG, max_tokens=40), "next")
        return result, finals, idle, after

    result, finals, idle, after = asyncio.run(run())
    assert result == {"aborted_count": 3, "request_ids": ["r0", "r1", "r2"]}
    for final in finals:
        tokens = final["token_ids"]
        assert final["stop_reason"] == "aborted" and 0 < len(tokens) < 200
        assert len(final["log_probs"]) == len(tokens)
        assert tokens == after["token_ids"][: len(tokens)]  # greedy: a prefix of the full run
    assert idle
    assert after["stop_reason"] == "completed" and len(after["token_ids"]) == 40


def test_verl_abort_request_leaves_other_requests_and_clients_alone(engine) -> None:
    """verl's ``abort_request`` for one of two requests (the other streamed by another client,
    on its own event loop and thread): the aborted stream ends with "abort", the other finishes
    as if alone; an unknown id, and the aborted id again, are "not found"; ``abort_all_requests``
    with nothing running aborts nothing; the engine ends idle, every block free."""
    server = VerlServer(engine)
    short = dict(LONG, max_tokens=24)

    async def alone() -> dict[str, Any]:
        return await verl_generate(engine, list(PROMPTS[0]), short, "alone")

    async def run() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], bool]:
        gate = StepGate(engine)
        other = asyncio.create_task(asyncio.to_thread(asyncio.run, alone()))
        dropped = await started(engine, LONG, "drop")
        await gate.close()
        abort = asyncio.create_task(server.abort_request("drop"))
        dropped_final = await asyncio.wait_for(dropped, HANG_S)
        gate.open()
        results = [await abort, await server.abort_request("unknown")]
        results.append(await server.abort_request("drop"))
        other_final = await asyncio.wait_for(other, HANG_S)
        results.append(await server.abort_all_requests())
        return results, dropped_final, other_final, await engine_is_idle(engine)

    results, dropped, other, idle = asyncio.run(run())
    assert results == [
        {"aborted": True, "request_id": "drop"},
        {"aborted": False, "error": "Request unknown not found"},
        {"aborted": False, "error": "Request drop not found"},
        {"aborted_count": 0, "request_ids": []},
    ]
    assert dropped["stop_reason"] == "aborted" and 0 < len(dropped["token_ids"]) < 200
    expected = asyncio.run(verl_generate(engine, list(PROMPTS[0]), short, "reference"))
    assert other["token_ids"] == expected["token_ids"] and other["stop_reason"] == "completed"
    assert other["log_probs"] == pytest.approx(expected["log_probs"], abs=1e-4)  # other batches
    assert idle


def test_request_states_snapshots_from_another_thread_while_requests_finish(engine) -> None:
    """verl snapshots ``list(request_states.items())`` and builds outputs from its own thread
    while the loop finishes requests: no snapshot fails, and building changes nothing (every
    request finishes with its own outputs). ``request_states`` is a read-only copy: one taken
    while requests ran still lists them after they finished."""
    errors: list[BaseException] = []
    stop = threading.Event()
    from vllm.v1.engine import FinishReason

    def snapshot_forever() -> None:
        while not stop.is_set():
            try:
                for _, state in list(engine.output_processor.request_states.items()):
                    state.make_request_output([], None, FinishReason.ABORT, None)
            except BaseException as error:  # the test reports any
                errors.append(error)
                return

    taken: list[Any] = []

    async def run() -> list[dict[str, Any]]:
        short = dict(LONG, max_tokens=3)
        calls = [verl_generate(engine, list(PROMPTS[i % 3]), short, f"s{i}") for i in range(24)]
        finals = asyncio.gather(*calls)
        await until(lambda: bool(engine.output_processor.request_states))
        taken.append(engine.output_processor.request_states)
        taken.append(list(taken[0]))
        return list(await finals)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    snapshotter = threading.Thread(target=snapshot_forever)
    snapshotter.start()
    try:
        finals = asyncio.run(asyncio.wait_for(run(), HANG_S))
    finally:
        stop.set()
        snapshotter.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert all(f["stop_reason"] == "completed" and len(f["token_ids"]) == 3 for f in finals)
    snapshot, listed = taken
    assert list(snapshot) == listed and listed and not engine.output_processor.request_states
    with pytest.raises(TypeError):
        del snapshot[listed[0]]  # type: ignore[attr-defined]


def test_abort_outputs_for_delta_and_final_only_streams(engine) -> None:
    """A DELTA stream aborted through the output processor ends with the tokens it was not
    handed yet, so its deltas add up to the tokens generated; a FINAL_ONLY stream has no
    unfinished output to build (None, as vLLM's), and its abort output holds the tokens
    generated so far, as vLLM's does (the loop builds it between two steps, so it is aborted
    once the gate is open)."""
    from dormant.core.sampling_params import RequestOutputKind

    async def stream(request_id: str, kind: RequestOutputKind) -> list[Any]:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        generate = engine.generate(PROMPTS[0], params, request_id, output_kind=kind)
        return [output async for output in generate]

    def has_two_tokens(request_id: str) -> bool:  # a request added a step later has one
        state = engine.output_processor.request_states.get(request_id)
        output = None if state is None else state.make_request_output([], None, None, None)
        return output is not None and len(output.outputs[0].token_ids) > 1

    async def run() -> tuple[list[Any], list[Any], Any]:
        gate = StepGate(engine)
        delta = asyncio.create_task(stream("delta", RequestOutputKind.DELTA))
        final_only = asyncio.create_task(stream("final", RequestOutputKind.FINAL_ONLY))
        await until(lambda: has_two_tokens("delta"))
        await gate.close()
        states = engine.output_processor.request_states
        unfinished = states["final"].make_request_output([], None, None, None)
        removed = engine.output_processor.abort_requests(["delta", "gone"])
        deltas = await asyncio.wait_for(delta, HANG_S)
        gate.open()
        removed += engine.output_processor.abort_requests(["final"])
        outputs = await asyncio.wait_for(final_only, HANG_S)
        await engine.engine_core.abort_requests_async(removed)
        assert removed == ["delta", "final"] and await engine_is_idle(engine)
        return deltas, outputs, unfinished

    deltas, (final,), unfinished = asyncio.run(run())
    tokens = [t for output in deltas for t in output.outputs[0].token_ids]
    assert deltas[-1].outputs[0].finish_reason == "abort" and 0 < len(tokens) < 200
    full = asyncio.run(stream("full", RequestOutputKind.CUMULATIVE))[-1].outputs[0].token_ids
    assert tokens == full[: len(tokens)]
    assert unfinished is None
    final_tokens = final.outputs[0].token_ids
    assert final.outputs[0].finish_reason == "abort" and 0 < len(final_tokens) < 200
    assert final_tokens == full[: len(final_tokens)] and final.finished
    assert final.prompt_token_ids == list(PROMPTS[0]) and final.request_id == "final"


def test_finish_reason_is_vllms(vllm_stand_in) -> None:
    """``vllm.v1.engine.FinishReason``: an IntEnum whose ``str()`` is the outputs' string."""
    import enum

    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    assert issubclass(FinishReason, enum.IntEnum)
    assert [(int(r), str(r)) for r in FinishReason][:3] == [
        (0, "stop"),
        (1, "length"),
        (2, "abort"),
    ]
    assert issubclass(EngineGenerateError, RuntimeError) and EngineDeadError is not None
