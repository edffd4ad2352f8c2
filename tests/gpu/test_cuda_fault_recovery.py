"""A failed cuMemRelease in the middle of a level-1 sleep on a real GPU (issue #11): the cuda
backend keeps the handle, status tells the truth, and both recoveries (wake first, or repeat the
sleep) bring every byte back. The exhaustive sweep runs on the host backend
(tests/memory/test_fault_injection.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dormant.memory import (
    DriverError,
    MemoryManager,
    Policy,
    SleepFailedError,
    State,
    TagState,
)
from tests.memory.helpers import random_fill, same_bytes

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def fail_release_once(mm: MemoryManager, monkeypatch: pytest.MonkeyPatch, k: int) -> list[int]:
    """Makes the backend's ``k``-th release (from now) raise DriverError before calling the
    driver; returns the list of handles it was asked to release."""
    real: Callable[[int], None] = mm.backend.release
    asked: list[int] = []

    def release(handle: int) -> None:
        asked.append(handle)
        if len(asked) == k:
            raise DriverError("cuMemRelease failed: injected by the test")
        real(handle)

    monkeypatch.setattr(mm.backend, "release", release)
    return asked


@pytest.mark.parametrize("recovery", ["wake_first", "repeat_sleep"])
def test_a_failed_release_during_sleep_recovers(
    cuda_mm: MemoryManager, monkeypatch: pytest.MonkeyPatch, recovery: str
) -> None:
    mm = cuda_mm
    w = mm.empty((6 * MiB,), torch.uint8, "weights")
    table = mm.empty((1000,), torch.int32, "runtime")
    kv = mm.empty((6 * MiB,), torch.uint8, "kv_cache")
    expected_w, expected_table = random_fill(w, 1), random_fill(table, 2)
    asked = fail_release_once(mm, monkeypatch, k=2)  # the first release is the KV cache's

    with pytest.raises(SleepFailedError, match="cuMemRelease") as caught:
        mm.sleep(level=1)
    assert caught.value.tag_states["kv_cache"] is TagState.DISCARDED
    status = mm.status()
    unmapped = [a for a in mm._table.allocations() if a.state is State.UNMAPPED]
    assert len(unmapped) == 1 and unmapped[0].handle == asked[1]
    assert unmapped[0].handle in mm.backend._handles  # the ownership record is kept
    assert status.tag(unmapped[0].tag).state is TagState.PARTIAL
    assert status.tag(unmapped[0].tag).num_by_state[State.UNMAPPED] == 1
    assert mm.asleep_tags["kv_cache"] is Policy.DISCARD and mm.is_sleeping(unmapped[0].tag)

    if recovery == "repeat_sleep":
        mm.sleep(level=1)  # retries the weights' release; the runtime is copied and released
        assert mm.tag_states()["weights"] is TagState.OFFLOADED
        assert mm.tag_states()["runtime"] is TagState.OFFLOADED
        assert mm.status().tag("weights").held_bytes == 0
    report = mm.wake_up()
    assert report.lost == () and not mm.is_sleeping()
    torch.cuda.synchronize()
    assert same_bytes(w, expected_w) and same_bytes(table, expected_table)

    monkeypatch.undo()
    assert len(mm.backend._handles) == len(list(mm._table.allocations()))  # no stray handle
    mm.sleep(level=1)
    assert mm.backend._handles == {}  # every handle released, none forgotten
    mm.wake_up()
    assert same_bytes(w, expected_w) and same_bytes(table, expected_table)
    del kv
