"""A driver call that fails in the middle of a sleep or wake (DESIGN §2.3, "Failures are
recoverable"): status tells the truth, the next wake maps back everything, the next sleep
completes, and nothing leaks. The exhaustive sweep over every call is test_fault_injection.py."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from dormant.memory import (
    MemoryManager,
    Policy,
    SleepConflictError,
    SleepFailedError,
    State,
    TagState,
    WakeFailedError,
)
from tests.memory.faults import FaultyBackend, check_truth, expect_driver_error
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


@pytest.fixture
def faulty() -> FaultyBackend:
    return FaultyBackend()


@pytest.fixture
def mm(faulty: FaultyBackend):
    manager = MemoryManager(faulty)
    yield manager
    manager.close()


def test_a_failed_release_leaves_the_truth_and_wake_brings_everything_back(
    mm: MemoryManager, faulty: FaultyBackend
) -> None:
    """Issue #11: the second release of a level-1 sleep fails. It used to leave asleep_tags empty
    and every tag 'awake' while the weights were unmapped (state MAPPED) and the KV cache
    discarded; wake_up() then woke nothing and reading the weights segfaulted."""
    w = mm.empty((3 * MiB,), torch.uint8, "weights")
    kv = mm.empty((3 * MiB,), torch.uint8, "kv_cache")
    expected = random_fill(w, 1)
    faulty.arm("release", 2)  # the first release is the KV cache's, the second the weights'
    error = expect_driver_error(lambda: mm.sleep(level=1))
    assert isinstance(error, SleepFailedError) and "release" in str(error)
    assert mm.asleep_tags == {"kv_cache": Policy.DISCARD}
    assert mm.is_sleeping("weights") and mm.is_sleeping("kv_cache")
    assert mm.tag_states()["weights"] is TagState.PARTIAL
    assert mm.status().tag("weights").num_by_state[State.UNMAPPED] == 1
    assert error.tag_states == {"weights": TagState.PARTIAL, "kv_cache": TagState.DISCARDED}
    assert "weights partial (1 unmapped)" in str(error) and "kv_cache discarded" in str(error)
    check_truth(mm, faulty)
    report = mm.wake_up()
    assert set(report.tags) == {"weights", "kv_cache"} and report.lost == ()
    check_truth(mm, faulty)
    assert same_bytes(w, expected) and not mm.is_sleeping()
    del kv


def test_repeating_a_failed_sleep_completes_it(mm: MemoryManager, faulty: FaultyBackend) -> None:
    """An UNMAPPED allocation being slept again only retries its release; its copy landed."""
    w = mm.empty((3 * MiB,), torch.uint8, "weights")
    expected = random_fill(w, 2)
    faulty.arm("release", 1)
    expect_driver_error(lambda: mm.sleep(tags={"weights": "host"}))
    faulty.arm()
    report = mm.sleep(tags={"weights": "host"})
    assert report.tags == {"weights": Policy.HOST} and report.bytes_copied == 0
    assert faulty.calls == {"synchronize": 1, "release": 1}  # nothing copied: no wait
    assert mm.tag_states()["weights"] is TagState.OFFLOADED
    check_truth(mm, faulty)
    mm.wake_up()
    assert same_bytes(w, expected)


def test_a_failed_unmap_keeps_the_allocation_mapped(
    mm: MemoryManager, faulty: FaultyBackend
) -> None:
    w = mm.empty((3 * MiB,), torch.uint8, "weights")
    expected = random_fill(w, 3)
    faulty.arm("unmap", 1)
    expect_driver_error(lambda: mm.sleep(level=1))
    (allocation,) = mm._table.allocations(["weights"])
    assert allocation.state is State.MAPPED and allocation.handle is not None
    assert allocation.has_host_copy  # the copy landed before the unmap was tried
    assert mm.tag_states()["weights"] is TagState.AWAKE
    check_truth(mm, faulty)
    assert same_bytes(w, expected)  # still mapped: readable without a wake
    mm.sleep(level=1)
    mm.wake_up()
    assert same_bytes(w, expected)


def test_an_unmapped_allocation_conflicts_with_another_policy(
    mm: MemoryManager, faulty: FaultyBackend
) -> None:
    w = mm.empty((3 * MiB,), torch.uint8, "weights")
    expected = random_fill(w, 4)
    faulty.arm("release", 1)
    expect_driver_error(lambda: mm.sleep(tags={"weights": "host"}))
    with pytest.raises(SleepConflictError, match=r"weights.*HOST.*partial.*DISCARD"):
        mm.sleep(tags={"weights": "discard"})
    check_truth(mm, faulty)
    mm.wake_up(["weights"])
    assert same_bytes(w, expected)


def test_a_failed_wake_rolls_back_and_the_next_wake_succeeds(
    mm: MemoryManager, faulty: FaultyBackend
) -> None:
    w = mm.empty((3 * MiB,), torch.uint8, "weights")
    kv = mm.empty((3 * MiB,), torch.uint8, "kv_cache")
    expected = random_fill(w, 5)
    mm.sleep(level=1)
    faulty.arm("map", 2)
    error = expect_driver_error(lambda: mm.wake_up())
    assert isinstance(error, WakeFailedError) and "rolled back" in str(error)
    assert mm.asleep_tags == {"weights": Policy.HOST, "kv_cache": Policy.DISCARD}
    check_truth(mm, faulty)
    mm.wake_up()
    assert same_bytes(w, expected)
    del kv


def test_an_offloaded_allocation_without_a_host_copy_is_reported_lost(
    faulty: FaultyBackend,
) -> None:
    """Unreachable with the sleep order, so the state is built directly: the wake must say which
    bytes it could not restore, and hand back zeroes rather than stale arena bytes."""
    mm = MemoryManager(faulty, max_slab_bytes=2 * MiB, slab_rules={})  # 3 MiB: its own handle
    w = mm.empty((3 * MiB,), torch.uint8, "weights")
    table = mm.empty((1000,), torch.uint8, "weights")
    random_fill(w, 6)
    expected_table = random_fill(table, 7)
    mm.sleep(level=1)
    big = next(a for a in mm._table.allocations(["weights"]) if a.size == 4 * MiB)
    big.has_host_copy = False
    report = mm.wake_up()
    assert report.lost == (("weights", 4 * MiB),) and report.bytes_lost == 4 * MiB
    assert "LOST" in mm.status().table()
    assert int(w.max()) == 0 and same_bytes(table, expected_table)
    assert mm.sleep(level=1).bytes_copied == 4 * MiB  # no valid copy: copied again; the slab not
    del w, table
    mm.close()


def test_transition_errors_travel_between_processes() -> None:
    error = SleepFailedError("release failed", {"weights": TagState.PARTIAL})
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is SleepFailedError and copy.tag_states == error.tag_states
    assert str(copy) == "release failed"


def test_nothing_leaks_after_failures(faulty: FaultyBackend) -> None:
    mm = MemoryManager(faulty, arena_chunk_bytes=2 * MiB)
    tensors = [mm.empty((n,), torch.uint8, "weights") for n in (3 * MiB, 3 * MiB, 1000)]
    kv = mm.empty((3 * MiB,), torch.uint8, "kv_cache")
    faulty.arm("pin", 2)  # the arena grows by several chunks: the second one fails
    expect_driver_error(lambda: mm.sleep(level=1))
    assert faulty.num_pinned == 0 and mm.arena.capacity_bytes == 0
    faulty.arm("release", 3)
    expect_driver_error(lambda: mm.sleep(level=1))
    check_truth(mm, faulty)
    del tensors, kv
    gc.collect()
    mm.close()
    host = faulty.inner
    assert host.live_handles() == {} and host.live_reservations() == {}
    assert host.mapped_ranges() == {} and faulty.num_pinned == 0
