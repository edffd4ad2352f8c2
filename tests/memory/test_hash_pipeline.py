"""A sleep hashes its HOST allocations in groups, largest first (offload.hash_groups), launched
back to back, and knows every digest before its first copy: a digest download queued behind a
running device-to-host copy waits for all of it (offload.py, H200 2026-12-01b). Unchanged
allocations found before the first changed one are released while later groups still hash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dormant.memory import MemoryManager, offload
from dormant.memory.allocation import Allocation, Kind
from dormant.memory.copy_path import CopyPath
from tests.memory.faults import FaultyBackend
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


class RecordingBackend(FaultyBackend):
    """Records the order of unmaps, hash groups, copies and the copies landing."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def unmap(self, va: int, size: int) -> None:
        self.events.append(("unmap", size))
        self.inner.unmap(va, size)

    def copy_batch(self, path=CopyPath.COPY_ENGINE):  # type: ignore[no-untyped-def]
        inner, events, sizes = self.inner.copy_batch(path), self.events, []

        class Copies:
            def add(self, copy):  # type: ignore[no-untyped-def]
                events.append(("copy", copy.nbytes))
                sizes.append(copy.nbytes)
                return inner.add(copy)

            def wait(self, index):  # type: ignore[no-untyped-def]
                inner.wait(index)
                events.append(("copy landed", sizes[index]))

            def wait_all(self):  # type: ignore[no-untyped-def]
                inner.wait_all()

        return Copies()

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
    monkeypatch.setattr(offload, "HASH_GROUP_MIN_BYTES", 4 * MiB)


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture
def mm(backend: RecordingBackend) -> Iterator[MemoryManager]:
    manager = MemoryManager(backend, max_slab_bytes=2 * MiB, slab_rules={})  # a handle per tensor
    yield manager
    manager.close()


def allocation(size: int) -> Allocation:
    return Allocation(tag="t", va=0, size=size, kind=Kind.TENSOR, handle=None)


def test_groups_are_largest_first_and_of_similar_bytes(small_groups: None) -> None:
    sizes = [2, 8, 4, 6, 2, 2, 10, 4, 4, 6]
    groups = offload.hash_groups([allocation(n * MiB) for n in sizes])
    flat = [a.size for group in groups for a in group]
    assert flat == sorted(flat, reverse=True) and len(flat) == len(sizes)
    target = max(sum(sizes) * MiB // offload.HASH_GROUPS, 4 * MiB)
    assert all(sum(a.size for a in group) >= target for group in groups[:-1])
    assert offload.hash_groups([]) == []


def test_unchanged_allocations_are_released_as_their_group_is_hashed(
    small_groups: None, mm: MemoryManager, backend: RecordingBackend
) -> None:
    """Nothing is copied, so no digest can wait behind a copy: each group's unchanged
    allocations are released as soon as its digests land, while the later groups still hash."""
    tensors = [mm.empty((n * MiB,), torch.uint8, "weights") for n in (2, 8, 4, 6, 10)]
    expected = [random_fill(t, seed) for seed, t in enumerate(tensors)]
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    backend.events.clear()
    count = len(tensors)  # asleep tensors stay out of assertions: their repr would fault
    report = mm.sleep(tags={"weights": "host"})
    assert report.bytes_copied == 0 and report.bytes_skipped == 30 * MiB
    unmaps = [size for kind, size in backend.events if kind == "unmap"]
    assert unmaps == sorted(unmaps, reverse=True) and len(unmaps) == count
    kinds = [kind for kind, _ in backend.events]
    groups = kinds.count("hash")
    assert groups > 1 and kinds[:groups] == ["hash"] * groups  # every group launched first
    # then group by group: its result, then its releases, before the next group's result
    assert kinds[groups] == "hash result" and kinds[groups + 1] == "unmap"
    results = [i for i, kind in enumerate(kinds) if kind == "hash result"]
    assert all(kinds[i + 1] == "unmap" for i in results)
    assert report.release_s > 0 and report.hash_s >= 0 and report.discard_s == 0
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))


def test_a_changed_group_stops_the_early_releases(
    small_groups: None, mm: MemoryManager, backend: RecordingBackend
) -> None:
    """Once a stale allocation is found, the unchanged ones after it are released under the
    copies, and no copy starts before the last digest is known."""
    tensors = [mm.empty((n * MiB,), torch.uint8, "weights") for n in (10, 8, 6, 4, 2)]
    [random_fill(t, seed) for seed, t in enumerate(tensors)]
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    tensors[2][5] ^= 1  # the 6 MiB one: a later group than the 10 MiB one
    expected = [t.clone() for t in tensors]
    backend.events.clear()
    report = mm.sleep(tags={"weights": "host"})
    assert report.bytes_copied == 6 * MiB
    events = backend.events
    copy_at = events.index(("copy", 6 * MiB))
    last_result = max(i for i, (kind, _) in enumerate(events) if kind == "hash result")
    assert last_result < copy_at
    unmapped_at = {size: i for i, (kind, size) in enumerate(events) if kind == "unmap"}
    assert unmapped_at[10 * MiB] < last_result  # before the stale one: released while hashing
    assert all(copy_at < unmapped_at[n * MiB] for n in (4, 2))  # after it: under the copy
    assert unmapped_at[6 * MiB] > events.index(("copy landed", 6 * MiB))
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))


def test_changed_sleep_starts_every_copy_before_any_release(
    small_groups: None, mm: MemoryManager, backend: RecordingBackend
) -> None:
    tensors = [mm.empty((n * MiB,), torch.uint8, "weights") for n in (2, 8, 4, 6, 10)]
    kv = mm.empty((16 * MiB,), torch.uint8, "kv_cache")
    [random_fill(t, seed) for seed, t in enumerate(tensors)]
    mm.sleep(tags={"weights": "host", "kv_cache": "discard"})
    mm.wake_up()
    for t in tensors[1:]:
        t[7] ^= 1  # all but the 2 MiB one changed
    expected = [t.clone() for t in tensors]
    backend.events.clear()
    report = mm.sleep(tags={"weights": "host", "kv_cache": "discard"})
    assert report.bytes_copied == 28 * MiB and report.bytes_skipped == 2 * MiB
    kinds = [kind for kind, _ in backend.events]
    last_result = max(i for i, kind in enumerate(kinds) if kind == "hash result")
    copies = [i for i, kind in enumerate(kinds) if kind == "copy"]
    unmaps = [(i, size) for i, (kind, size) in enumerate(backend.events) if kind == "unmap"]
    assert last_result < copies[0] and copies[-1] < unmaps[0][0]
    copied = [size for kind, size in backend.events if kind == "copy"]
    assert copied == sorted(copied, reverse=True) == [n * MiB for n in (10, 8, 6, 4)]
    # the KV cache first, then the unchanged allocation, then each copied one once it landed
    assert [size for _, size in unmaps] == [16 * MiB, 2 * MiB, *copied]
    del kv
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
