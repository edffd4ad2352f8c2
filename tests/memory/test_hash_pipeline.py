"""A sleep hashes its HOST allocations in groups, largest first (transitions.hash_groups): each
group's copies start, and its unchanged allocations are released, while later groups hash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dormant.memory import MemoryManager, transitions
from dormant.memory.allocation import Allocation, Kind
from tests.memory.faults import FaultyBackend
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


class RecordingBackend(FaultyBackend):
    """Records the order of unmaps, hash groups and copies."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def unmap(self, va: int, size: int) -> None:
        self.events.append(("unmap", size))
        self.inner.unmap(va, size)

    def hash_batch(self):  # type: ignore[no-untyped-def]
        inner, events = self.inner.hash_batch(), self.events

        class Hashes:
            def add(self, spans):  # type: ignore[no-untyped-def]
                events.append(("hash", sum(s.nbytes for s in spans)))
                return inner.add(spans)

            def wait(self, index):  # type: ignore[no-untyped-def]
                events.append(("hash result", index))
                return inner.wait(index)

        return Hashes()


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transitions, "HASH_GROUP_MIN_BYTES", 4 * MiB)


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture
def mm(backend: RecordingBackend) -> Iterator[MemoryManager]:
    manager = MemoryManager(backend, max_slab_bytes=2 * MiB)  # every tensor its own handle
    yield manager
    manager.close()


def allocation(size: int) -> Allocation:
    return Allocation(tag="t", va=0, size=size, kind=Kind.TENSOR, handle=None)


def test_groups_are_largest_first_and_of_similar_bytes(small_groups: None) -> None:
    sizes = [2, 8, 4, 6, 2, 2, 10, 4, 4, 6]
    groups = transitions.hash_groups([allocation(n * MiB) for n in sizes])
    flat = [a.size for group in groups for a in group]
    assert flat == sorted(flat, reverse=True) and len(flat) == len(sizes)
    target = max(sum(sizes) * MiB // transitions.HASH_GROUPS, 4 * MiB)
    assert all(sum(a.size for a in group) >= target for group in groups[:-1])
    assert transitions.hash_groups([]) == []


def test_unchanged_allocations_are_released_largest_first_while_later_groups_hash(
    small_groups: None, mm: MemoryManager, backend: RecordingBackend
) -> None:
    tensors = [mm.empty((n * MiB,), torch.uint8, "weights") for n in (2, 8, 4, 6, 10)]
    expected = [random_fill(t, seed) for seed, t in enumerate(tensors)]
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    backend.events.clear()
    report = mm.sleep(tags={"weights": "host"})
    assert report.bytes_copied == 0 and report.bytes_skipped == 30 * MiB
    unmaps = [size for kind, size in backend.events if kind == "unmap"]
    assert unmaps == sorted(unmaps, reverse=True)
    kinds = [kind for kind, _ in backend.events]
    results = [i for i, kind in enumerate(kinds) if kind == "hash result"]
    assert len(results) > 1 and kinds.index("unmap") < results[1]  # before the next group's
    assert kinds[: len(results)] == ["hash"] * len(results)  # all groups launched first
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))


def test_only_the_changed_allocation_of_a_later_group_is_copied(
    small_groups: None, mm: MemoryManager
) -> None:
    tensors = [mm.empty((n * MiB,), torch.uint8, "weights") for n in (2, 8, 4, 6, 10)]
    [random_fill(t, seed) for seed, t in enumerate(tensors)]
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    tensors[0][123] ^= 1  # the smallest: the last group
    expected = [t.clone() for t in tensors]
    report = mm.sleep(tags={"weights": "host"})
    assert report.bytes_copied == 2 * MiB and report.bytes_skipped == 28 * MiB
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
