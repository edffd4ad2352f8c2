"""The engine freezes the start-up heap out of the garbage collector's sight, and gives it back
at shutdown (``engine/gc_heap.py``), so a rollout's collections do not traverse the loaded
engine again and again, and an engine that is shut down leaves no frozen cycle behind."""

from __future__ import annotations

import gc
import weakref

import pytest

from dormant import LLM

pytestmark = pytest.mark.usefixtures("unfrozen")


@pytest.fixture
def unfrozen() -> None:
    gc.unfreeze()  # whatever an earlier test's engine froze and never gave back
    yield
    gc.unfreeze()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_first_engine_freezes_the_heap_until_its_shutdown(checkpoint) -> None:
    before = Cycle()
    seen = weakref.ref(before)
    llm = LLM(str(checkpoint), max_model_len=64)
    assert gc.get_freeze_count() > 0
    del before
    gc.collect()
    assert seen() is not None  # frozen: its cycle is not collected while the engine runs
    llm.shutdown()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert seen() is None  # unfrozen at shutdown: collected


def test_garbage_of_the_start_up_is_collected_before_the_freeze(checkpoint) -> None:
    garbage = Cycle()
    seen = weakref.ref(garbage)
    del garbage  # unreachable, not yet collected: frozen, it would live until the shutdown
    gc.disable()  # no automatic collection during the start-up: only the engine's own
    try:
        llm = LLM(str(checkpoint), max_model_len=64)
    finally:
        gc.enable()
    try:
        assert seen() is None
    finally:
        llm.shutdown()


def test_a_heap_frozen_by_someone_else_is_left_as_it_is(checkpoint) -> None:
    before = Cycle()
    seen = weakref.ref(before)
    gc.freeze()  # someone else's freeze, holding the cycle
    del before
    llm = LLM(str(checkpoint), max_model_len=64)
    llm.shutdown()
    # The count is no measure: a frozen object that dies by reference counting lowers it
    # (CI saw 622370 become 622368). A frozen cycle outliving a full collection is.
    gc.collect()
    assert gc.get_freeze_count() > 0
    assert seen() is not None  # not unfrozen by the engine, neither at start-up nor shutdown
