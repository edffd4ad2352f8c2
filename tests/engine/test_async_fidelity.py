"""``AsyncLLM`` against vLLM's ``AsyncLLM`` and the callers RL frameworks are: one client's
closed event loop or cancelled call never strands another, a loop that fails hands every waiter
``EngineDeadError`` (vLLM's ``errored`` / ``dead_error`` / ``check_health``), and vLLM's call
shapes (``from_engine_args(..., stat_loggers=[])``, ``reset_prefix_cache(reset_running_requests=
True)``) work. Each test fails without its fix; none depends on wall-clock timing to pass (the
steps are held by events, and a timeout only turns a hang into a failure)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.core.errors import EngineDeadError, UnsupportedOptionError
from dormant.engine.async_llm import AsyncLLM
from tests.engine.conftest import write_checkpoint
from tests.server.tokenizer_files import write_tokenizer

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
)
PROMPT = [5, 17, 99, 3, 250, 42]
HANG_S = 60  # only a hang reaches it
HELD: list[HeldSteps] = []  # the steps held by the running test, freed at its teardown


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("async_fidelity"), seed=1)
    write_tokenizer(path)
    return path


@pytest.fixture
def engine(model_dir: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(model_dir), enable_sleep_mode=True, **OPTIONS)
    yield engine
    while HELD:  # a test that failed while holding steps must not hang the shutdown
        HELD.pop().free()
    engine.shutdown()


class HeldSteps:
    """Steps that wait, while ``is_held()``, for the test to let each one through: commands
    queued meanwhile run one step apart, when the test says."""

    def __init__(self, engine: AsyncLLM, is_held: Callable[[], bool]) -> None:
        HELD.append(self)
        self.is_held = is_held
        self.is_free = threading.Event()
        self._tickets = threading.Semaphore(0)
        self._step = engine.engine.step
        engine.engine.step = self.step  # type: ignore[method-assign]

    def step(self):
        if self.is_held() and not self.is_free.is_set():
            self._tickets.acquire()
        return self._step()

    def let_one_through(self) -> None:
        self._tickets.release()

    def free(self) -> None:
        self.is_free.set()
        self._tickets.release()


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)


async def first_output_then(engine: AsyncLLM, params: SamplingParams, request_id: str):
    """Starts a stream; returns its task once it produced an output."""
    started = asyncio.Event()

    async def run():
        outputs = []
        async for output in engine.generate(PROMPT, params, request_id):
            outputs.append(output)
            started.set()
        return outputs

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), HANG_S)
    return task


def test_a_client_whose_event_loop_closed_mid_request_strands_no_other(engine) -> None:
    """Regression: a request still running when its caller's event loop closed (``asyncio.run``
    returned) had its next output handed to the closed loop; the RuntimeError stopped the loop
    thread, and every later call of every client hung."""
    in_step, release = threading.Event(), threading.Event()
    step = engine.engine.step

    def step_after_release():
        if not release.is_set():
            in_step.set()
            release.wait()
        return step()

    engine.engine.step = step_after_release

    left_running: list[asyncio.Task[None]] = []

    async def leave_mid_request() -> None:
        async def consume():
            async for _ in engine.generate(PROMPT, greedy(8), "gone"):
                pass

        left_running.append(asyncio.create_task(consume()))  # asyncio.run cancels it
        await asyncio.to_thread(in_step.wait)

    asyncio.run(leave_mid_request())  # cancels the consumer and closes the loop mid-step
    release.set()

    async def other():
        return [o async for o in engine.generate(PROMPT, greedy(4), "other")]

    outputs = asyncio.run(asyncio.wait_for(other(), HANG_S))
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert engine.num_requests == 0 and not engine.errored


def test_a_failed_loop_hands_every_caller_engine_dead_error(engine, monkeypatch) -> None:
    """Regression: an error that escaped the loop thread (here a bug delivering progress) ended
    the thread silently: the running stream and every later call waited forever. Now each gets
    ``EngineDeadError`` caused by it, as vLLM's callers get ``dead_error``, and ``shutdown``
    still shuts the engine down."""
    bug = RuntimeError("a bug in delivering progress")

    def fail() -> None:
        raise bug

    monkeypatch.setattr(engine._requests, "send_progress", fail)
    shut_down = []
    monkeypatch.setattr(engine.llm, "shutdown", lambda: shut_down.append(True))

    async def run():
        with pytest.raises(EngineDeadError) as raised:
            async for _ in engine.generate(PROMPT, greedy(8), "a"):
                pass
        assert raised.value.__cause__ is bug
        assert engine.errored and engine.is_stopped and not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.is_sleeping()
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(PROMPT, greedy(8), "b"))

    asyncio.run(asyncio.wait_for(run(), HANG_S))
    engine.shutdown()
    engine.shutdown()
    assert shut_down == [True]


def test_a_pause_cancelled_while_draining_still_opens_the_gate(engine) -> None:
    """Regression: ``pause_generation(mode="wait")`` cancelled before the drain ended (a
    caller's ``wait_for`` timing out) left its drain waiter behind, so the gate it closed never
    opened: every later request was held forever."""
    steps = HeldSteps(engine, lambda: engine._engine_loop._is_gate_closed)

    async def run():
        running = await first_output_then(engine, greedy(64), "running")
        pause = asyncio.create_task(engine.pause_generation(mode="wait"))
        await until(lambda: engine._engine_loop._is_gate_closed)
        pause.cancel()
        steps.free()
        with pytest.raises(asyncio.CancelledError):
            await pause
        await running
        after = [o async for o in engine.generate(PROMPT, greedy(4), "after")]
        return after[-1].outputs[0].finish_reason

    assert asyncio.run(asyncio.wait_for(run(), HANG_S)) == "length"


def test_cancelling_a_duplicate_id_request_leaves_the_running_one_alone(engine) -> None:
    """Regression: a request cancelled before its add ran queued an abort by its caller id, so
    a second request reusing a running request's id, cancelled, aborted the first one."""
    block = threading.Event()

    async def run():
        first = await first_output_then(engine, greedy(32), "dup")
        engine._engine_loop.submit(block.wait)  # the loop runs nothing else until released
        second = asyncio.create_task(anext(engine.generate(PROMPT, greedy(4), "dup")))
        await until(lambda: "dup" in engine._requests._pending)  # its add is queued
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        block.set()
        return await first

    outputs = asyncio.run(asyncio.wait_for(run(), HANG_S))
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 32


def test_a_held_request_aborted_ends_with_an_aborted_output(engine) -> None:
    """Regression: ``abort`` of a request held behind a draining ``wait`` pause raised
    ``CancelledError`` out of its stream, in a task nobody cancelled; vLLM (and ``abort``'s
    contract) ends the stream with an output whose finish_reason is "abort"."""
    steps = HeldSteps(engine, lambda: engine._engine_loop._is_gate_closed)

    async def run():
        running = await first_output_then(engine, greedy(64), "running")
        pause = asyncio.create_task(engine.pause_generation(mode="wait"))
        await until(lambda: engine._engine_loop._is_gate_closed)
        held = asyncio.create_task(asyncio.wait_for(_collect(engine, "held"), HANG_S))
        await until(lambda: "held" in engine._requests._pending)
        steps.let_one_through()  # its add runs, and is held
        await until(lambda: engine._engine_loop.num_held == 1)
        abort = asyncio.create_task(engine.abort("held"))
        steps.let_one_through()  # the abort runs
        await abort
        steps.free()
        await pause
        await engine.resume_generation()
        await running
        return await held

    outputs = asyncio.run(asyncio.wait_for(run(), HANG_S))
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert outputs[-1].outputs[0].token_ids == []
    assert engine.num_requests == 0


async def _collect(engine: AsyncLLM, request_id: str):
    return [o async for o in engine.generate(PROMPT, greedy(4), request_id)]


def test_vllms_call_shapes(model_dir) -> None:
    """``from_engine_args(args, stat_loggers=[])`` (NeMo-RL's async worker),
    ``reset_prefix_cache(reset_running_requests=True)``, ``get_tokenizer()`` and
    ``is_paused()``: vLLM's signatures; a stat logger is refused with a typed error."""
    with pytest.raises(UnsupportedOptionError, match="stat_loggers"):
        AsyncLLM.from_engine_args({"model": str(model_dir), **OPTIONS}, stat_loggers=[object()])
    engine = AsyncLLM.from_engine_args(
        {"model": str(model_dir), **OPTIONS}, start_engine_loop=True, stat_loggers=[]
    )

    async def run():
        reset = await engine.reset_prefix_cache(reset_running_requests=True)
        paused = [await engine.is_paused()]
        await engine.pause_generation(mode="keep")
        paused.append(await engine.is_paused())
        await engine.resume_generation()
        return reset, paused

    try:
        reset, paused = asyncio.run(run())
        assert engine.get_tokenizer() is engine.llm.get_tokenizer() is not None
    finally:
        engine.shutdown()
    assert reset is True and paused == [False, True]


def test_generate_after_shutdown_raises_engine_dead_error(model_dir) -> None:
    """Regression: it raised the tokenizer pool's RuntimeError ("cannot schedule new futures
    after shutdown"); vLLM raises ``EngineDeadError``."""
    engine = AsyncLLM(str(model_dir), **OPTIONS)
    engine.shutdown()

    async def run():
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(PROMPT, greedy(4), "late"))
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    asyncio.run(run())
    assert engine.errored


def test_pause_generation_takes_vllms_keywords(engine) -> None:
    """vllm/v1/engine/async_llm.py ``pause_generation(*, mode, wait_for_inflight_requests,
    clear_cache=True)`` (SkyRL and PRIME-RL pass the keywords; they raised TypeError):
    ``wait_for_inflight_requests=False`` aborts the running request, ``True`` lets it finish,
    and ``clear_cache`` drops the cached prefix blocks."""
    cache = engine.engine.scheduler.block_manager.prefix_cache_stats

    async def run() -> tuple[str | None, str | None, int]:
        running = await first_output_then(engine, greedy(200), "aborted")
        await engine.pause_generation(wait_for_inflight_requests=False, clear_cache=False)
        aborted = (await asyncio.wait_for(running, HANG_S))[-1].outputs[0].finish_reason
        resets = cache().num_resets
        await engine.resume_generation()
        running = await first_output_then(engine, greedy(6), "finished")
        await engine.pause_generation(wait_for_inflight_requests=True)
        finished = (await asyncio.wait_for(running, HANG_S))[-1].outputs[0].finish_reason
        await engine.resume_generation()
        return aborted, finished, cache().num_resets - resets

    aborted, finished, num_resets = asyncio.run(run())
    assert (aborted, finished, num_resets) == ("abort", "length", 1)


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_a_slow_reader_holds_the_newest_output_not_one_per_step(engine, kind: str) -> None:
    """Regression: every step's cumulative output (a copy of the prompt and of the tokens so
    far) was queued for a reader that did not read, memory growing with the square of the
    length. Now an unread output is replaced by the newer one (vLLM's RequestOutputCollector
    merges the same way): a reader back after the request finished gets one output, and the
    deltas still add up to the whole."""
    from dormant.core.sampling_params import RequestOutputKind

    output_kind = RequestOutputKind.DELTA if kind == "delta" else RequestOutputKind.CUMULATIVE

    async def run() -> tuple[list[int], int]:
        stream = engine.generate(PROMPT, greedy(24), "slow", output_kind=output_kind)
        first = await asyncio.wait_for(anext(stream), HANG_S)
        await asyncio.wait_for(until(lambda: engine.num_requests == 0), HANG_S)
        rest = [output async for output in stream]  # the reader comes back
        pieces = [first, *rest] if kind == "delta" else [rest[-1]]
        return [t for o in pieces for t in o.outputs[0].token_ids], len(rest)

    tokens, num_after = asyncio.run(run())
    assert num_after == 1 and len(tokens) == 24
    whole = asyncio.run(_collect_tokens(engine, greedy(24), "whole"))
    assert tokens == whole


async def _collect_tokens(engine: AsyncLLM, params: SamplingParams, request_id: str) -> list[int]:
    outputs = [o async for o in engine.generate(PROMPT, params, request_id)]
    return list(outputs[-1].outputs[0].token_ids)


def test_the_newest_slot_never_replaces_a_last_item() -> None:
    """``Newest``: a newer output replaces an unread one; the finished output and an error are
    last and stay (an engine stopping right after a request finished must not turn its result
    into an error)."""
    from dormant.engine.outputs import RequestOutput
    from dormant.engine.request_stream import Newest

    def output(finished: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], None, [], finished)

    async def run() -> list[object]:
        slot, taken = Newest(), []
        running, newer, final = output(False), output(False), output(True)
        slot.put(running)
        slot.put(newer)
        taken.append(await slot.get())
        slot.put(final)
        slot.put(EngineDeadError("stopped"))
        taken.append(await slot.get())
        error = EngineDeadError("failed")
        slot.put(error)
        slot.put(output(False))
        taken.append(await slot.get())
        return [taken[0] is newer, taken[1] is final, taken[2] is error]

    assert asyncio.run(run()) == [True, True, True]
