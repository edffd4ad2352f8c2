"""Fixtures shared by the framework call-sequence tests."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest


@pytest.fixture
def spawn() -> Iterator[Callable[..., Connection]]:
    """Starts trainer processes (spawned, as Ray's are fresh), each given the child end of a
    pipe as its last argument; returns the parent end. Kills any left at the end."""
    context = mp.get_context("spawn")
    started: list[Any] = []

    def start(target: Any, *args: Any) -> Connection:
        parent, child = context.Pipe()
        process = context.Process(target=target, args=(*args, child), daemon=True)
        process.start()
        started.append(process)
        return parent

    yield start
    for process in started:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
