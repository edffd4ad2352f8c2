"""Shared test configuration: GPU tests are marked ``gpu`` and skip cleanly without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dormant import LLM

# The fake libcuda of the zero-residual mode's CPU tests (fake_driver, old_driver).
pytest_plugins = ["tests.fake_driver"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """The engines a test made (it appends them); shut down, in order, when it ends, then
    torch's cached device blocks are freed, so the next test starts on an empty device."""
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.shutdown()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
