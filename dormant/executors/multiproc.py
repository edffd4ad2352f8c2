"""``MultiprocExecutor``: tensor parallelism on one host, one worker process per rank.

It starts one worker process per rank (spawned, on a free port), sends each
the same typed command, and gathers the results in rank order; it doubles as a barrier. A worker
that dies or stops answering makes every later call raise ``EngineDeadError`` and shuts the
others down.

``launch`` sends a step without waiting for its replies (the engine's async scheduling): each
rank's pipe is first in, first out, so replies are read in the order the commands were sent,
and any command first reads the replies of the steps sent before it (``RemoteStep``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.errors import EngineDeadError
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput
from dormant.executors.worker_process import worker_main

STARTUP_TIMEOUT_S = 600.0
COMMAND_TIMEOUT_S = 1800.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, init_method: str | None = None) -> None:
        self.world_size = config.tensor_parallel_size
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        context = mp.get_context("spawn")
        self.processes: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._is_dead = False
        self._unread: deque[RemoteStep] = deque()  # steps sent, replies not yet read
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(rank, self.world_size, config, init_method, child_end, os.getpid()),
                name=f"dormant-worker-{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self.processes.append(process)
            self._conns.append(parent_end)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._conns)
        self.pids = self._gather(STARTUP_TIMEOUT_S)

    def run(self, command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        self._read_unread()
        self._send(command, args, kwargs)
        return self._gather(COMMAND_TIMEOUT_S)

    def execute(self, step: StepInput) -> StepOutput:
        return self.run(Command.EXECUTE, step)[0]  # every rank sampled the same tokens

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        return self.run(Command.EXECUTE_MULTI_STEP, step)[0]

    def launch(self, step: StepInput, multi_step: bool = False) -> RemoteStep:
        """Sends the step to every rank and returns before their replies (``RemoteStep``): the
        engine applies the step before it while the ranks compute this one."""
        self._send(Command.EXECUTE_MULTI_STEP if multi_step else Command.EXECUTE, (step,), {})
        sent = RemoteStep(self)
        self._unread.append(sent)
        return sent

    def read_oldest(self) -> None:
        """Reads the replies of the oldest step sent and not read, into it."""
        sent = self._unread.popleft()
        try:
            sent.output = self._gather(COMMAND_TIMEOUT_S)[0]
        except BaseException as error:
            sent.error = error
            if isinstance(error, EngineDeadError):
                raise

    def _read_unread(self) -> None:
        """Reads every step's replies still in the pipes, so a command reads its own."""
        while self._unread:
            self.read_oldest()

    def _send(self, command: Command, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._is_dead:
            raise EngineDeadError("the engine's workers are gone; create a new engine")
        for conn in self._conns:
            try:
                conn.send((command, args, kwargs))
            except (BrokenPipeError, OSError) as error:
                self._die(f"a worker stopped answering ({error})")

    def shutdown(self) -> None:
        if not self._is_dead:
            self._is_dead = True
            self._finalizer()

    def _gather(self, timeout: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while pending:
            ready = wait([*pending.values(), *sentinels], timeout=timeout)
            if not ready:
                self._die(f"no answer from ranks {sorted(pending)} in {timeout:.0f} s")
            for item in ready:
                if item in sentinels:
                    rank = sentinels[item]
                    if rank in pending and not pending[rank].poll():
                        code = self.processes[rank].exitcode
                        self._die(f"worker rank {rank} died (exit code {code})")
                    continue
                rank = next(r for r, c in pending.items() if c is item)
                try:
                    status, value = cast(Connection, item).recv()
                except (EOFError, OSError) as error:  # closed, or reset by a dying worker
                    self._die(f"worker rank {rank} is gone ({type(error).__name__})")
                del pending[rank]
                results[rank] = (status, value)
        for status, value in results:
            if status == "error":
                raise value
        return [value for _, value in results]

    def _die(self, reason: str) -> None:
        self.shutdown()
        raise EngineDeadError(f"{reason}; every worker was shut down. Create a new engine.")


class RemoteStep:
    """A step sent to every rank; ``result`` reads the replies (those of every step sent before
    it first) and returns rank 0's output, or raises what a rank raised."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self.output: StepOutput | None = None
        self.error: BaseException | None = None

    def result(self) -> StepOutput:
        while self.output is None and self.error is None:
            self._executor.read_oldest()
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output


def _stop(processes: list[mp.process.BaseProcess], conns: list[Connection]) -> None:
    """Asks every live worker to shut down, then makes sure none is left."""
    for process, conn in zip(processes, conns, strict=True):
        if process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send((Command.SHUTDOWN, (), {}))
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    for conn in conns:
        conn.close()
