"""``EngineLoop``: the one thread that touches the engine, and the commands it runs for others.

The engine is not thread-safe, so only the loop thread touches it. Every other call is a
*command* run by the loop between two steps, never during one; after running commands the loop
decides again whether it may step, so a sleep queued behind a step never meets a step.

What the loop does between steps, as a table::

    state                                   loop
    ──────────────────────────────────────  ───────────────────────────────────────────────
    no unfinished request, or engine         block until a command arrives
    paused / asleep / weights stale
    requests runnable                       run queued commands, then one step, then
                                            deliver finished outputs and progress
    gate closed (a ``wait`` pause, sleep     new requests are held, not added; the loop
    or refit draining)                      steps until every request finished, then the
                                            command that closed the gate runs and opens it

After ``stop`` every command, queued or new, fails with ``EngineDeadError``, and so does every
request being generated or held. A step that raises ``EngineDeadError`` (its workers died)
stops the loop the same way with that error, as vLLM's engine is dead once its core is; any
other failed step fails only the requests it ran, which are aborted, and the loop serves on.
An error that escapes the loop itself (a bug, not a failed step) stops it too, with the error
as the ``EngineDeadError``'s cause: no caller is left waiting on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from dormant.core.errors import EngineAsleepError, EngineDeadError
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.request_tracker import RequestTracker

Command = tuple[Callable[[], Any], Future[Any]]


class _Deferred:
    """A command's return value meaning "its future is resolved later" (a held request)."""


_DEFERRED = _Deferred()


class EngineLoop:
    """Steps ``engine`` on its own thread and delivers through ``requests``; ``call`` and
    ``submit`` run commands on that thread between two steps."""

    def __init__(self, engine: LLMEngine, requests: RequestTracker) -> None:
        self.engine = engine
        self.requests = requests
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._is_gate_closed = False
        self._held: list[Command] = []
        self._drain_waiters: list[Future[None]] = []
        self.dead_error: EngineDeadError | None = None  # set once, when the loop stops
        self._stop_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dormant-async-llm", daemon=True)
        self._thread.start()

    @property
    def is_stopped(self) -> bool:
        return self.dead_error is not None

    @property
    def num_held(self) -> int:
        """Commands held behind the closed gate (read off the loop: an instant's count)."""
        return len(self._held)

    async def call(self, fn: Callable[[], Any], *, holdable: bool = False) -> Any:
        """Runs ``fn`` on the loop between two steps; returns its result or raises its error.
        A ``holdable`` command (adding a request) waits while the gate is closed."""
        future: Future[Any] = Future()
        if holdable:  # held while the gate is closed; run when it opens
            inner = fn

            def fn() -> Any:
                if self._is_gate_closed:
                    self._held.append((inner, future))
                    return _DEFERRED
                return inner()

        return await asyncio.wrap_future(self.submit(fn, future))

    def call_blocking(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the loop between two steps and waits for it, blocking this thread
        (at most for the step in progress); on the loop thread itself, runs it at once. For
        callers that cannot await (vLLM's synchronous internals); raises ``fn``'s error, or
        ``EngineDeadError`` once the loop stopped."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    def submit(self, fn: Callable[[], Any], future: Future[Any] | None = None) -> Future[Any]:
        """Queues ``fn`` without waiting (safe from any thread, and in a ``finally``)."""
        future = future or Future()
        with self._stop_lock:
            if self.dead_error is not None:
                _answer(future, error=self.dead_error)
                return future
            self._commands.put((fn, future))
        return future

    async def settled(self, mode: str, command: Callable[[], Any]) -> Any:
        """Runs ``command`` on the loop; for ``mode == "wait"`` first closes the gate (new
        requests are held) and lets the loop finish every runnable request."""
        if mode != "wait":
            return await self.call(command)
        drained: Future[None] = Future()
        try:  # cancelled at any await, the gate still opens: commands run in order
            await self.call(lambda: self._close_gate(drained))
            await asyncio.wrap_future(drained)
            return await self.call(command)
        finally:
            await self.call(lambda: self._open_gate(drained))

    def stop(self) -> None:
        """Fails every request and command with ``EngineDeadError`` and joins the thread."""
        self.submit(self._stop)
        self._thread.join()

    # ── on the loop thread ───────────────────────────────────────────────────────────────────

    def _run(self) -> None:
        try:
            self._run_until_stopped()
        except BaseException as error:  # a bug in the loop: fail everyone, don't strand them
            dead = EngineDeadError(f"the engine loop failed ({error!r}); shut the engine down")
            dead.__cause__ = error
            self._fail_everything(dead)
        self._drain_commands_after_stop()

    def _run_until_stopped(self) -> None:
        while not self.is_stopped:
            self._resolve_drain_waiters()  # before blocking: a drain may just have ended
            self._run_commands(block=not self._can_step())
            drained = self.engine.pop_drained_outputs()  # a command completed calls in flight
            if drained:
                self.requests.deliver(drained)
            self._resolve_drain_waiters()
            if self.is_stopped or not self._can_step():  # decided again, after the commands
                continue
            try:
                finished = self.engine.step()
            except EngineDeadError as error:  # the workers are gone: no step can run again
                self._fail_everything(error)
                continue
            except BaseException as error:  # fail the requests instead of retrying forever
                self.engine.abort_request()
                self.requests.fail_all(error)
                continue
            self.requests.deliver(finished)
            self.requests.send_progress()

    def _can_step(self) -> bool:
        if not self.engine.has_unfinished_requests():
            return False
        try:
            self.engine.check_can_generate()
        except EngineAsleepError:
            return False
        return True

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        """Runs ``fn`` even when its caller has gone (a held add must still run, to drop
        itself), and answers the caller if it still waits."""
        try:
            result = fn()
        except BaseException as error:
            _answer(future, error=error)
            return
        if result is not _DEFERRED:
            _answer(future, result)

    # ── the gate: draining before a wait-mode sleep, pause or refit ──────────────────────────

    def _close_gate(self, drained: Future[None]) -> None:
        self._is_gate_closed = True
        self._drain_waiters.append(drained)

    def _open_gate(self, drained: Future[None]) -> None:
        if drained in self._drain_waiters:  # its caller was cancelled before the drain ended
            self._drain_waiters.remove(drained)
        if self._drain_waiters:  # another drain is still waiting: it opens the gate
            return
        self._is_gate_closed = False
        held, self._held = self._held, []
        for command in held:
            self._run_command(*command)

    def _resolve_drain_waiters(self) -> None:
        """Drained: nothing left that the loop could step (paused or asleep requests stay)."""
        if self._drain_waiters and not self._can_step():
            waiters, self._drain_waiters = self._drain_waiters, []
            for waiter in waiters:
                _answer(waiter, None)

    # ── stopping ─────────────────────────────────────────────────────────────────────────────

    def _stop(self) -> None:
        try:
            self.engine.abort_request()
        finally:  # stopped even if the abort failed: ``stop`` joins the thread
            self._fail_everything(EngineDeadError("the engine was shut down"))

    def _fail_everything(self, error: EngineDeadError) -> None:
        """Stops: every request, held command and drain waiter gets ``error``; so do the
        commands queued or submitted later (``_drain_commands_after_stop``, ``submit``)."""
        with self._stop_lock:
            self.dead_error = self.dead_error or error
        self.requests.fail_all(error)
        held, self._held = self._held, []
        waiters, self._drain_waiters = self._drain_waiters, []
        for future in [f for _, f in held] + waiters:
            _answer(future, error=error)

    def _drain_commands_after_stop(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            _answer(future, error=self.dead_error)


def _answer(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolves ``future`` unless its caller cancelled it (a request's task cancelled while its
    add was held): then nobody waits, and resolving it would raise in the loop."""
    with contextlib.suppress(InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
