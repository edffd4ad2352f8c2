"""Shared test configuration: GPU tests are marked ``gpu`` and skip cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

# The fake libcuda of the zero-residual mode's CPU tests (fake_driver, old_driver).
pytest_plugins = ["tests.fake_driver"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
