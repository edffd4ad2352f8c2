"""``EngineLoop`` and the drain rule (async scheduling): a command that completed the calls in
flight leaves the requests they finished with the engine, and the loop delivers them after the
command, even when the engine cannot step afterwards (a release or sleep came with it)."""

from __future__ import annotations

import time
from typing import Any

from dormant.core.errors import EngineAsleepError
from dormant.engine.engine_loop import EngineLoop


class AsleepEngine:
    """What the loop asks of an engine, asleep: it holds only what a drain finished."""

    def __init__(self) -> None:
        self.drained: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.drained)  # LLMEngine counts what a drain left too

    def check_can_generate(self) -> None:
        raise EngineAsleepError("asleep")

    def pop_drained_outputs(self) -> list[str]:
        drained, self.drained = self.drained, []
        return drained

    def step(self) -> list[str]:
        raise AssertionError("an asleep engine is never stepped")

    def abort_request(self, request_ids: Any = None) -> list[str]:
        return []


class Tracker:
    def __init__(self) -> None:
        self.delivered: list[str] = []

    def deliver(self, outputs: list[str]) -> None:
        self.delivered += outputs

    def send_progress(self) -> None: ...

    def fail_all(self, error: BaseException) -> None: ...


def test_requests_a_command_drained_are_delivered_while_the_engine_sleeps() -> None:
    engine, tracker = AsleepEngine(), Tracker()
    loop = EngineLoop(engine, tracker)  # type: ignore[arg-type]
    try:
        loop.submit(lambda: engine.drained.append("finished by the drain")).result(timeout=10)
        deadline = time.monotonic() + 10
        while not tracker.delivered and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert tracker.delivered == ["finished by the drain"]
    assert engine.drained == []
