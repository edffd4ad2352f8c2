"""What the GPU tests share: small engines on the GPU, each shut down when its test ends, and a
poisoning memory manager on the cuda backend (``cuda_mm``).

A test takes the ``engines`` fixture (tests/conftest.py: it shuts them down and frees torch's
cache) and makes its engines with ``make_engine(engines, checkpoint, **options)``;
``options`` override ``ENGINE_DEFAULTS``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dormant import LLM
from dormant.memory import MemoryManager

MiB = 1 << 20
ENGINE_DEFAULTS = dict(
    device="cuda", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=16 * MiB
)


@pytest.fixture
def cuda_mm() -> Iterator[MemoryManager]:
    """A MemoryManager on the cuda backend in poison mode, closed when the test ends."""
    mm = MemoryManager("cuda", poison=True)
    yield mm
    mm.close()


def make_engine(engines: list[LLM], checkpoint: Path | str, **options: object) -> LLM:
    """An engine of ``checkpoint`` with ``ENGINE_DEFAULTS`` and ``options`` (which win), added
    to ``engines``."""
    llm = LLM(str(checkpoint), **{**ENGINE_DEFAULTS, **options})  # type: ignore[arg-type]
    engines.append(llm)
    return llm
