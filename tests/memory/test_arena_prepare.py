"""The host arena prepared in the background (arena.py): the first sleep after it only copies;
a sleep that comes early waits for it; a preparation that fails changes nothing."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch

from dormant.memory import DriverError, ManagerClosedError, MemoryManager, UnknownTagError
from dormant.memory.host_backend import HostBackend
from tests.memory.faults import FaultyBackend, check_truth
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


class GatedBackend(FaultyBackend):
    """Pins wait until ``gate`` is set: a preparation that is still running."""

    def __init__(self) -> None:
        super().__init__(HostBackend())
        self.gate = threading.Event()

    def pin(self, address: int, size: int) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        super().pin(address, size)


@pytest.fixture
def faulty() -> FaultyBackend:
    return FaultyBackend()


@pytest.fixture
def mm(faulty: FaultyBackend) -> Iterator[MemoryManager]:
    manager = MemoryManager(faulty, arena_chunk_bytes=4 * MiB)
    yield manager
    manager.close()


def fill(mm: MemoryManager) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Weights (HOST at level 1, DISCARD at level 2), runtime (HOST) and KV (DISCARD)."""
    specs = [(6 * MiB, "weights"), (100, "weights"), (3 * MiB, "runtime"), (8 * MiB, "kv_cache")]
    tensors = [mm.empty((n,), torch.uint8, tag) for n, tag in specs]
    return tensors, [random_fill(t, seed) for seed, t in enumerate(tensors)]


def test_the_first_sleep_after_a_preparation_only_copies(
    mm: MemoryManager, faulty: FaultyBackend
) -> None:
    tensors, expected = fill(mm)
    preparation = mm.prepare_arena(level=1)
    preparation.wait()
    assert preparation.is_done and preparation.error is None and preparation.seconds is not None
    host_bytes = sum(t.numel() for t in tensors[:3])
    assert host_bytes <= preparation.nbytes == mm.arena.capacity_bytes
    faulty.arm()
    report = mm.sleep(level=1)
    assert faulty.calls["pin"] == 0  # nothing left to pin: the sleep copied and released
    assert report.bytes_copied >= host_bytes and mm.arena.capacity_bytes == preparation.nbytes
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors[:3], expected[:3], strict=True))
    again = mm.prepare_arena(level=1)  # every HOST allocation has its region now
    assert again.nbytes == 0 and again.is_done
    del tensors


def test_a_level_prepares_only_what_it_would_offload(mm: MemoryManager) -> None:
    tensors, _ = fill(mm)
    preparation = mm.prepare_arena(level=2)  # weights are discarded at level 2
    preparation.wait()
    runtime = sum(a.size for a in mm._table.allocations(["runtime"]))
    assert preparation.nbytes == runtime
    del tensors


def test_a_sleep_that_comes_early_waits_for_the_preparation() -> None:
    gated = GatedBackend()
    mm = MemoryManager(gated, arena_chunk_bytes=4 * MiB)
    tensors, expected = fill(mm)
    preparation = mm.prepare_arena(level=1)
    done = threading.Event()
    sleeper = threading.Thread(target=lambda: (mm.sleep(level=1), done.set()))
    gated.arm()
    sleeper.start()
    assert not done.wait(0.2) and not preparation.is_done  # held until the pins can land
    gated.gate.set()
    sleeper.join(30)
    assert done.is_set() and preparation.is_done and preparation.error is None
    assert mm.arena.capacity_bytes == preparation.nbytes  # the sleep grew nothing itself
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors[:3], expected[:3], strict=True))
    del tensors
    gc.collect()
    mm.close()


def test_a_failed_preparation_changes_nothing_and_the_sleep_grows_the_arena(
    mm: MemoryManager, faulty: FaultyBackend
) -> None:
    tensors, expected = fill(mm)
    faulty.arm("pin", 1)
    preparation = mm.prepare_arena(level=1, num_threads=1)
    with pytest.raises(DriverError, match="injected failure"):
        preparation.wait()
    assert isinstance(preparation.error, DriverError)
    assert mm.arena.capacity_bytes == 0 and faulty.num_pinned == 0  # all or nothing
    check_truth(mm, faulty)
    mm.sleep(level=1)
    assert mm.arena.capacity_bytes > 0
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors[:3], expected[:3], strict=True))
    del tensors


def test_closing_while_a_preparation_runs_leaks_nothing() -> None:
    gated = GatedBackend()
    mm = MemoryManager(gated, arena_chunk_bytes=4 * MiB)
    tensors, _ = fill(mm)
    preparation = mm.prepare_arena(level=1)
    del tensors
    gc.collect()
    threading.Timer(0.1, gated.gate.set).start()
    mm.close()  # the arena goes with the last block: it waits for the preparation first
    assert preparation.is_done and gated.num_pinned == 0 and mm.arena.capacity_bytes == 0


def test_bad_requests_raise_and_start_nothing(mm: MemoryManager) -> None:
    with pytest.raises(UnknownTagError):
        mm.prepare_arena(tags={"nonsense": "host"})
    with pytest.raises(TypeError):
        mm.prepare_arena(level=1, tags={"weights": "host"})
    with pytest.raises(ValueError, match="unknown sleep level"):
        mm.prepare_arena(level=7)
    assert mm.arena.preparation is None
    mm.close()
    with pytest.raises(ManagerClosedError):
        mm.prepare_arena(level=1)


def test_a_smaller_sleep_first_leaves_the_prepared_arena_whole_for_level_1(
    mm: MemoryManager, faulty: FaultyBackend
) -> None:
    """A level-2 sleep before the first level-1 one (the runtime's region taken from the
    prepared chunks) must not take it from the chunk sized for the weights: first fit did, and
    the level-1 sleep grew and pinned a weights-sized chunk again (2.0 s for 12.5 GB in
    tp_scenario.py on an H100, 2026-12-06b run 2)."""
    tensors, expected = fill(mm)
    mm.prepare_arena(level=1).wait()
    capacity = mm.arena.capacity_bytes
    mm.sleep(level=2)  # the runtime: a region of the prepared arena
    mm.wake_up()
    faulty.arm()
    report = mm.sleep(level=1)
    assert faulty.calls["pin"] == 0 and report.arena_s < 0.1
    assert mm.arena.capacity_bytes == capacity
    mm.wake_up()
    assert same_bytes(tensors[2], expected[2])  # the runtime
    del tensors
