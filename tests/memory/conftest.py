"""Fixtures for the memory layer: every test that can runs on the host backend and, on a GPU
machine, on the cuda backend too."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from dormant.memory import MemoryManager

BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_mm(device: str) -> Iterator[Callable[..., MemoryManager]]:
    """Creates managers on ``device`` and closes them after the test."""
    managers: list[MemoryManager] = []

    def make(**options: object) -> MemoryManager:
        manager = MemoryManager(device, **options)  # type: ignore[arg-type]
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.close()


@pytest.fixture
def mm(make_mm: Callable[..., MemoryManager]) -> MemoryManager:
    return make_mm()
