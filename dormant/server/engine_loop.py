"""One thread owns the engine; the server's request threads hand it work.

The engine is not thread-safe, so only the loop thread ever touches it. Request threads put
commands (plain callables) on a queue and wait for their results; between two engine steps the
loop runs every queued command, so a ``sleep`` or a refit lands between steps, never inside one.
Generation requests resolve when their sequence finishes: in a step, or when a sleep aborts or
drains it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import RequestOutput
from dormant.engine.sampling_params import SamplingParams

T = TypeVar("T")


class EngineStoppedError(RuntimeError):
    """The engine loop was stopped (the server is shutting down)."""


class EngineLoop:
    """Drives ``engine`` from a daemon thread. Every public method may be called from any
    thread and blocks until the loop has done the work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._pending: dict[str, Future[RequestOutput]] = {}
        self._is_stopped = False
        self._stop_lock = threading.Lock()  # no command is queued after the loop stopped
        self._thread = threading.Thread(target=self._run, name="dormant-engine-loop", daemon=True)
        self._thread.start()

    def generate(
        self, prompts: Sequence[str | list[int]], params: SamplingParams
    ) -> list[RequestOutput]:
        """Queues every prompt (all or none: a refused request queues nothing) and waits for
        them to finish. Raises what ``check_can_generate``/``add_request`` raise."""

        def add() -> list[Future[RequestOutput]]:
            self.engine.check_can_generate()
            ids = []
            try:
                for prompt in prompts:
                    ids.append(self.engine.add_request(prompt, params))
            except BaseException:
                self.engine.abort_request(ids)
                raise
            futures = [Future[RequestOutput]() for _ in ids]
            self._pending.update((str(i), f) for i, f in zip(ids, futures, strict=True))
            return futures

        return [future.result() for future in self.call(add)]

    def sleep(self, level: int, mode: str) -> None:
        self.call(lambda: self._deliver(self.engine.sleep(level, mode)))

    def call(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the loop thread between two steps; returns its result or raises its
        error."""
        future: Future[T] = Future()
        with self._stop_lock:
            if self._is_stopped:
                raise EngineStoppedError("the engine loop was stopped")
            self._commands.put((fn, future))
        return future.result()

    def stop(self) -> None:
        """Stops the loop; requests still waiting fail with ``EngineStoppedError``."""
        if not self._is_stopped:
            self.call(self._stop)
            self._thread.join()

    def _stop(self) -> None:
        with self._stop_lock:
            self._is_stopped = True
        self.engine.abort_request()
        for future in self._pending.values():
            future.set_exception(EngineStoppedError("the server is shutting down"))
        self._pending.clear()

    def _run(self) -> None:
        while not self._is_stopped:
            has_work = self.engine.has_unfinished_requests() and not self.engine.is_sleeping()
            self._run_commands(block=not has_work)
            if self._is_stopped or not has_work:
                continue
            try:
                self._deliver(self.engine.step())
            except BaseException as error:  # fail the requests instead of retrying forever
                self.engine.abort_request()
                for future in self._pending.values():
                    future.set_exception(error)
                self._pending.clear()
        while True:  # commands that raced with the stop
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(EngineStoppedError("the engine loop was stopped"))

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            fn, future = command
            try:
                future.set_result(fn())
            except BaseException as error:
                future.set_exception(error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            future = self._pending.pop(output.request_id, None)
            if future is not None:
                future.set_result(output)
