"""Wake is transactional: on OOM it rolls back, raises a typed error, and a later wake succeeds."""

from __future__ import annotations

import gc

import pytest
import torch

from dormant.memory import MemoryManager, WakeOutOfMemoryError
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


def make_manager(capacity: int) -> MemoryManager:
    """A host manager of ``capacity`` bytes, with a 'trainer' tag standing in for the trainer's
    memory (never put to sleep)."""
    mm = MemoryManager("host", host_capacity=capacity)
    mm.register_tag("trainer", levels={0: "keep", 1: "keep", 2: "keep"})
    return mm


def test_wake_oom_rolls_back_and_a_later_wake_succeeds() -> None:
    mm = make_manager(48 * MiB)
    try:
        w = mm.empty((16 * MiB,), torch.uint8, "weights")
        table = mm.empty((1000,), torch.int32, "runtime")
        kv = mm.empty((16 * MiB,), torch.uint8, "kv_cache")
        expected_w, expected_table = random_fill(w, 1), random_fill(table, 2)
        mm.sleep(level=1)
        before = [(t.tag, t.state, t.mapped_bytes) for t in mm.status().tags]
        used = mm.backend.used_bytes
        assert used == 0

        trainer = mm.empty((40 * MiB,), torch.uint8, "trainer")  # the trainer takes the room
        with pytest.raises(WakeOutOfMemoryError) as caught:
            mm.wake_up()
        error = caught.value
        assert error.bytes_requested == 16 * MiB + 2 * MiB + 16 * MiB
        assert error.bytes_free == 8 * MiB
        assert "35,651,584 bytes" in str(error) and "8,388,608" in str(error)
        # Nothing half-mapped, every state as it was.
        assert mm.backend.used_bytes == 40 * MiB
        assert [
            (t.tag, t.state, t.mapped_bytes) for t in mm.status().tags if t.tag != "trainer"
        ] == [b for b in before if b[0] != "trainer"]
        assert mm.is_sleeping("weights") and mm.is_sleeping("kv_cache")

        del trainer
        gc.collect()
        mm.wake_up()
        assert same_bytes(w, expected_w) and same_bytes(table, expected_table)
        assert not mm.is_sleeping()
        del kv
    finally:
        mm.close()


def test_partial_wake_fits_when_the_whole_does_not() -> None:
    mm = make_manager(40 * MiB)
    try:
        w = mm.empty((16 * MiB,), torch.uint8, "weights")
        kv = mm.empty((16 * MiB,), torch.uint8, "kv_cache")
        expected = random_fill(w, 3)
        mm.sleep(level=1)
        trainer = mm.empty((20 * MiB,), torch.uint8, "trainer")
        with pytest.raises(WakeOutOfMemoryError):
            mm.wake_up()
        mm.wake_up(["weights"])  # 16 MiB fit in the 20 MiB left
        assert same_bytes(w, expected)
        with pytest.raises(WakeOutOfMemoryError):
            mm.wake_up(["kv_cache"])
        assert mm.is_sleeping("kv_cache") and mm.backend.used_bytes == 36 * MiB
        del trainer
        gc.collect()
        mm.wake_up(["kv_cache"])
        del kv
    finally:
        mm.close()


def test_allocation_oom_is_typed_and_changes_nothing() -> None:
    from dormant.memory import OutOfMemoryError

    mm = MemoryManager("host", host_capacity=8 * MiB)
    try:
        with pytest.raises(OutOfMemoryError):
            mm.empty((9 * MiB,), torch.uint8, "weights")
        assert mm.status().tag("weights").num_allocations == 0
        assert mm.backend.used_bytes == 0
    finally:
        mm.close()
