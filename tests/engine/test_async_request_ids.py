"""One caller id names at most one request in flight (``RequestTracker``): vLLM <= 0.12 refuses
a second ``generate`` whose id is running ("Request id ... already running.", its
``OutputProcessor.add_request``), and registers a request when ``generate`` is called, so a
request whose add is still queued counts as running. A request aborted before its add ran frees
its id at once. The loop is held by a command that waits on an event, never by timing: a
timeout only turns a hang into a failure."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.core.errors import DuplicateRequestIdError
from dormant.engine.async_llm import AsyncLLM
from tests.engine.conftest import write_checkpoint

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
)
PROMPT = [5, 17, 99, 3, 250, 42]
HANG_S = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("async_request_ids"), seed=1)


@pytest.fixture
def engine(model_dir: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(model_dir), **OPTIONS)
    yield engine
    engine.shutdown()


@pytest.fixture
def blocked(engine: AsyncLLM) -> Iterator[threading.Event]:
    """The loop runs nothing (no add, no abort) until the event is set."""
    release = threading.Event()
    engine._engine_loop.submit(release.wait)
    yield release
    release.set()


async def collect(engine: AsyncLLM, request_id: str, max_tokens: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o async for o in engine.generate(PROMPT, params, request_id)]


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)


def test_a_second_request_whose_id_waits_to_be_added_is_refused_at_once(engine, blocked):
    """Regression: two ``generate`` calls with one id, both waiting to be added, shared one
    pending entry; an ``abort(id)`` that landed after the first add ran and before the second's
    did aborted the first and let the second run to its end. Now the second raises
    ``DuplicateRequestIdError`` before anything is queued (the loop is still blocked), the
    first is untouched, and ``abort(id)`` ends the one request of that id."""

    async def run() -> list:
        first = asyncio.create_task(collect(engine, "x", 200))
        await until(lambda: "x" in engine._requests._pending)
        pending = engine._requests._pending["x"]
        with pytest.raises(DuplicateRequestIdError, match="'x' already running"):
            await collect(engine, "x", 4)
        assert engine._requests._pending == {"x": pending}  # the refusal recorded nothing
        assert engine.output_processor.get_num_unfinished_requests() == 1
        blocked.set()
        await until(lambda: "x" in engine._requests._user_ids)  # the first is added
        await engine.abort("x")
        return await first

    outputs = asyncio.run(asyncio.wait_for(run(), HANG_S))
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 200
    assert engine.num_requests == 0 and not engine._requests._pending


def test_a_pending_request_cancelled_frees_its_id_before_its_add_runs(engine, blocked):
    """A request cancelled while its add waits leaves the pending set at once: a new request
    of its id is taken while the loop is still blocked (not refused as a duplicate), and runs
    to its end once the cancelled add has run, added and aborted."""

    async def run() -> list:
        cancelled = asyncio.create_task(collect(engine, "y", 200))
        await until(lambda: "y" in engine._requests._pending)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert "y" not in engine._requests._pending
        assert engine.output_processor.get_num_unfinished_requests() == 0
        again = asyncio.create_task(collect(engine, "y", 4))
        await until(lambda: "y" in engine._requests._pending)
        blocked.set()
        return await again

    outputs = asyncio.run(asyncio.wait_for(run(), HANG_S))
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert engine.num_requests == 0 and not engine._requests._pending
