"""Unchanged HOST memory is not copied again; any change, even one byte, is detected."""

from __future__ import annotations

import pytest
import torch

from dormant.memory import MemoryManager
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


def test_unchanged_weights_are_not_copied_again(mm: MemoryManager) -> None:
    w = mm.empty((6 * MiB,), torch.uint8, "weights")
    expected = random_fill(w, 1)
    first = mm.sleep(tags={"weights": "host"})
    assert first.bytes_copied == 6 * MiB and first.bytes_skipped == 0
    wake = mm.wake_up()
    # Regression: the report counted copies after marking the allocations MAPPED, so it said 0.
    assert wake.bytes_copied == 6 * MiB and wake.bytes_mapped == 6 * MiB
    second = mm.sleep(tags={"weights": "host"})
    assert second.bytes_copied == 0 and second.bytes_skipped == 6 * MiB
    mm.wake_up()
    assert same_bytes(w, expected)


@pytest.mark.parametrize("position", [0, 1, 3 * MiB + 12345, 6 * MiB - 1])
def test_one_changed_byte_anywhere_is_detected_and_copied(mm: MemoryManager, position: int) -> None:
    w = mm.empty((6 * MiB,), torch.uint8, "weights")
    random_fill(w, 2)
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    w[position] ^= 0x01
    expected = w.clone()
    report = mm.sleep(tags={"weights": "host"})
    assert report.bytes_copied == 6 * MiB
    mm.wake_up()
    assert same_bytes(w, expected)


def test_only_the_changed_allocation_is_copied(mm: MemoryManager) -> None:
    a = mm.empty((4 * MiB,), torch.uint8, "weights")
    b = mm.empty((4 * MiB,), torch.uint8, "weights")
    random_fill(a, 3), random_fill(b, 4)
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    b[17] += 1
    expected = b.clone()
    report = mm.sleep(tags={"weights": "host"})
    assert report.bytes_copied == 4 * MiB and report.bytes_skipped == 4 * MiB
    mm.wake_up()
    assert same_bytes(b, expected)


def test_swapped_words_are_detected(mm: MemoryManager) -> None:
    w = mm.empty((MiB,), torch.int32, "weights")
    random_fill(w, 5)
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    w[[10, 11]] = w[[11, 10]].clone()
    assert mm.sleep(tags={"weights": "host"}).bytes_copied == 4 * MiB
    mm.wake_up()


def test_a_refit_after_discard_is_copied(mm: MemoryManager) -> None:
    w = mm.empty((4 * MiB,), torch.uint8, "weights")
    random_fill(w, 6)
    mm.sleep(level=1)
    mm.wake_up()
    mm.sleep(level=2)  # discarded: the arena still holds the old copy
    mm.wake_up()
    new = random_fill(w, 7)
    assert mm.sleep(level=1).bytes_copied >= 4 * MiB
    mm.wake_up()
    assert same_bytes(w, new)


def test_mark_dirty_forces_a_copy(mm: MemoryManager) -> None:
    w = mm.empty((4 * MiB,), torch.uint8, "weights")
    random_fill(w, 8)
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    mm.mark_dirty(w)
    assert mm.sleep(tags={"weights": "host"}).bytes_copied == 4 * MiB
    mm.wake_up()
    mm.mark_dirty("weights")
    assert mm.sleep(tags={"weights": "host"}).bytes_copied == 4 * MiB
    mm.wake_up()
    assert mm.sleep(tags={"weights": "host"}).bytes_copied == 0  # the hint is consumed
    mm.wake_up()


def test_skip_unchanged_off_always_copies(make_mm) -> None:
    mm = make_mm(skip_unchanged=False)
    w = mm.empty((4 * MiB,), torch.uint8, "weights")
    random_fill(w, 9)
    for _ in range(3):
        assert mm.sleep(tags={"weights": "host"}).bytes_copied == 4 * MiB
        mm.wake_up()
