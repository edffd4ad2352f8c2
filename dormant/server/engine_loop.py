"""One thread owns the engine; the server's request threads hand it work.

The engine is not thread-safe, so only the loop thread ever touches it. Request threads put
commands (plain callables) on a queue and wait for their results; between two engine steps the
loop runs every queued command, so a ``sleep`` or a refit lands between steps, never inside one.

Each generation request has a listener, called on the loop thread: with the request's output
so far after every step that added tokens (streaming listeners only), with its final output
when it finishes (in a step, or aborted or drained by a sleep), or with an exception if the
engine failed under it. Listeners must be quick and must not raise (``queue.put`` is typical).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from dormant.core.sampling_params import SamplingParams
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import RequestOutput

T = TypeVar("T")
Listener = Callable[[RequestOutput | BaseException], None]


class EngineStoppedError(RuntimeError):
    """The engine loop was stopped (the server is shutting down)."""


@dataclass
class _Request:
    listener: Listener
    is_streaming: bool
    num_tokens_sent: int = 0


class EngineLoop:
    """Drives ``engine`` from a daemon thread. Every public method may be called from any
    thread and blocks until the loop has done the work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._requests: dict[str, _Request] = {}
        self._is_stopped = False
        self._stop_lock = threading.Lock()  # no command is queued after the loop stopped
        self._thread = threading.Thread(target=self._run, name="dormant-engine-loop", daemon=True)
        self._thread.start()

    def generate(
        self, prompts: Sequence[str | list[int]], params: SamplingParams
    ) -> list[RequestOutput]:
        """Queues every prompt and waits for their final outputs, in prompt order."""
        futures = [Future[RequestOutput]() for _ in prompts]

        def settle(future: Future[RequestOutput]) -> Listener:
            def listener(item: RequestOutput | BaseException) -> None:
                if isinstance(item, BaseException):
                    future.set_exception(item)
                else:
                    future.set_result(item)

            return listener

        self.submit(prompts, params, [settle(f) for f in futures], is_streaming=False)
        return [future.result() for future in futures]

    def submit(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        listeners: Sequence[Listener],
        *,
        is_streaming: bool,
    ) -> list[int]:
        """Queues every prompt, each with its listener; returns the request ids. All or none:
        a refused request (asleep, too long, ...) queues nothing and raises here."""

        def add() -> list[int]:
            self.engine.check_can_generate()
            ids: list[int] = []
            try:
                for prompt in prompts:
                    ids.append(self.engine.add_request(prompt, params))
            except BaseException:
                self.engine.abort_request(ids)
                raise
            for request_id, listener in zip(ids, listeners, strict=True):
                self._requests[str(request_id)] = _Request(listener, is_streaming)
            return ids

        return self.call(add)

    def abort(self, request_ids: Sequence[int]) -> None:
        """Aborts requests (their listeners get the final, aborted outputs)."""
        self.call(lambda: self._deliver(self.engine.abort_request(request_ids)))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
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
        """Stops the loop; requests still running get ``EngineStoppedError``."""
        if not self._is_stopped:
            self.call(self._stop)
            self._thread.join()

    def _stop(self) -> None:
        with self._stop_lock:
            self._is_stopped = True
        self.engine.abort_request()
        self._fail_all(EngineStoppedError("the server is shutting down"))

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
                self._fail_all(error)
                continue
            self._send_progress()
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
            request = self._requests.pop(output.request_id, None)
            if request is not None:
                request.listener(output)

    def _send_progress(self) -> None:
        for request_id, request in self._requests.items():
            if not request.is_streaming:
                continue
            output = self.engine.request_output(int(request_id))
            if output is not None and len(output.outputs[0].token_ids) > request.num_tokens_sent:
                request.num_tokens_sent = len(output.outputs[0].token_ids)
                request.listener(output)

    def _fail_all(self, error: BaseException) -> None:
        for request in self._requests.values():
            request.listener(error)
        self._requests.clear()
