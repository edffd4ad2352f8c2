"""The multi-process executor's reaction to a broken pipe, made deterministic with stand-ins for
the worker's connection and process (the killed-worker test in test_tp_engine.py hits these
paths only by timing)."""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Iterator

import pytest

from dormant.core.commands import Command
from dormant.engine import EngineDeadError
from dormant.executors.multiproc import MultiprocExecutor


class BrokenConnection:
    """Readable at once (a byte waits in a real pipe); ``recv``/``send`` fail as given."""

    def __init__(self, readable_fd: int, recv_error: BaseException, send_error=None) -> None:
        self._fd, self.recv_error, self.send_error = readable_fd, recv_error, send_error

    def fileno(self) -> int:
        return self._fd

    def poll(self) -> bool:
        return True

    def recv(self) -> object:
        raise self.recv_error

    def send(self, message: object) -> None:
        if self.send_error is not None:
            raise self.send_error


class LiveProcess:
    """A worker that has not exited: its sentinel never becomes readable."""

    def __init__(self, fd: int) -> None:
        self.sentinel, self.exitcode = fd, None


@pytest.fixture
def pipes() -> Iterator[tuple[int, int]]:
    readable, writer = os.pipe()
    os.write(writer, b"x")
    idle, idle_writer = os.pipe()
    yield readable, idle
    for fd in (readable, writer, idle, idle_writer):
        os.close(fd)


def executor_with(connection: BrokenConnection, sentinel_fd: int) -> MultiprocExecutor:
    executor = object.__new__(MultiprocExecutor)  # no processes spawned
    executor.world_size = 1
    executor.processes = [LiveProcess(sentinel_fd)]  # type: ignore[list-item]
    executor._conns = [connection]  # type: ignore[list-item]
    executor._is_dead = False
    executor._unread = deque()
    executor._finalizer = weakref.finalize(executor, lambda: None)
    return executor


@pytest.mark.parametrize(
    "error", [ConnectionResetError(104, "Connection reset by peer"), EOFError()]
)
def test_a_reply_cut_off_by_a_dying_worker_is_engine_dead(pipes, error) -> None:
    readable, idle = pipes
    executor = executor_with(BrokenConnection(readable, error), idle)
    name = type(error).__name__
    with pytest.raises(EngineDeadError, match=rf"rank 0 is gone \({name}\).*new engine"):
        executor.run(Command.CHECK_HEALTH)
    with pytest.raises(EngineDeadError, match="workers are gone"):  # and stays dead
        executor.run(Command.CHECK_HEALTH)


def test_a_command_into_a_broken_pipe_is_engine_dead(pipes) -> None:
    readable, idle = pipes
    connection = BrokenConnection(readable, EOFError(), send_error=BrokenPipeError(32, "pipe"))
    executor = executor_with(connection, idle)
    with pytest.raises(EngineDeadError, match="stopped answering"):
        executor.run(Command.CHECK_HEALTH)
