"""The pieces under the manager: range allocation, DLPack views, the host backend, the arena."""

from __future__ import annotations

import ctypes
import gc
import random

import pytest
import torch

from dormant.memory import OutOfMemoryError
from dormant.memory.arena import HostArena, _chunk_plan
from dormant.memory.backend import Copy, Span
from dormant.memory.dlpack import tensor_at
from dormant.memory.host_backend import HostBackend
from dormant.memory.ranges import RangeAllocator

MiB = 1 << 20


@pytest.mark.parametrize("best_fit", [False, True])
def test_range_allocator_tiles_the_range_under_random_churn(best_fit: bool) -> None:
    ranges = RangeAllocator(1 << 16, alignment=256)
    rng = random.Random(0)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            ranges.free(offset)
            del live[offset]
        else:
            nbytes = rng.randint(1, 3000)
            offset = ranges.allocate(nbytes, best_fit=best_fit)
            if offset is None:
                assert ranges.tightest_fit(nbytes) is None
                continue
            assert offset % 256 == 0
            for other, size in live.items():  # no overlap with any live span
                assert offset + nbytes <= other or other + size <= offset
            live[offset] = -(-nbytes // 256) * 256
        free = sum(e - s for s, e in zip(ranges._free_starts, ranges._free_ends, strict=True))
        assert free + ranges.allocated_bytes == ranges.size
        ends = ranges._free_ends[:-1]
        starts = ranges._free_starts[1:]
        assert all(e < s for e, s in zip(ends, starts, strict=True))  # coalesced
    for offset in list(live):
        ranges.free(offset)
    assert ranges.is_empty and ranges.allocate(1 << 16) == 0


def test_best_fit_takes_the_smallest_free_span_that_holds_it() -> None:
    ranges = RangeAllocator(10 * 256, alignment=256)
    spans = [ranges.allocate(n * 256) for n in (1, 4, 1, 2, 1)]  # then free the 4 and the 2
    ranges.free(spans[1])
    ranges.free(spans[3])
    assert ranges.tightest_fit(2 * 256) == 2 * 256 and ranges.tightest_fit(5 * 256) is None
    assert ranges.allocate(2 * 256, best_fit=True) == spans[3]  # first fit takes the 4's
    assert ranges.allocate(256) == spans[1]


def test_dlpack_view_deleter_runs_when_the_last_view_dies() -> None:
    buffer = (ctypes.c_uint8 * 4096)()
    freed: list[int] = []
    t = tensor_at(ctypes.addressof(buffer), 4096, torch.device("cpu"), lambda: freed.append(1))
    view = t[128:256].view(torch.float32)
    view.fill_(1.5)
    assert buffer[131] == 0x3F
    del t
    gc.collect()
    assert freed == []
    del view
    gc.collect()
    assert freed == [1]


def test_host_backend_maps_at_the_same_address_with_zeroed_pages() -> None:
    backend = HostBackend()
    size = backend.granularity
    va = backend.reserve(size)
    for value in (7, 9):
        handle = backend.create(size)
        backend.map(va, size, handle)
        view = (ctypes.c_uint8 * size).from_address(va)
        assert view[0] == 0 and view[size - 1] == 0  # fresh memory reads zero
        view[0] = value
        backend.unmap(va, size)
        backend.release(handle)
    assert backend.used_bytes == 0
    backend.free_reservation(va, size)


def test_host_backend_capacity() -> None:
    backend = HostBackend(capacity=4 * MiB)
    handle = backend.create(4 * MiB)
    with pytest.raises(OutOfMemoryError) as caught:
        backend.create(2 * MiB)
    assert caught.value.bytes_requested == 2 * MiB and caught.value.bytes_free == 0
    assert backend.memory_info() == (0, 4 * MiB)
    backend.release(handle)
    assert backend.memory_info() == (4 * MiB, 4 * MiB)


def test_host_backend_copies_fills_and_hashes() -> None:
    backend = HostBackend()
    src = torch.arange(1024, dtype=torch.int32)
    dst = torch.zeros(1024, dtype=torch.int32)
    batch = backend.copy_batch()
    assert batch.add(Copy(dst.data_ptr(), src.data_ptr(), 4096)) == 0
    batch.wait(0)
    batch.wait_all()
    assert torch.equal(src, dst)
    backend.fill([Span(dst.data_ptr(), 8)], 0xFF)
    assert dst[0] == -1 and dst[1] == -1 and dst[2] == 2
    hashes = backend.hash_batch()
    first = hashes.add([Span(src.data_ptr(), 4096), Span(dst.data_ptr(), 4096)])
    dst[:2] = src[:2]
    second = hashes.add([Span(dst.data_ptr(), 4096)])
    h1, h2 = hashes.wait(first)
    assert len(h1) == 16 and h1 != h2
    assert hashes.wait(second) == [h1]  # each group's digests are of when it was added


def test_arena_places_regions_and_grows_once() -> None:
    arena = HostArena(HostBackend(), chunk_bytes=8 * MiB)
    regions = arena.allocate([3 * MiB, 10 * MiB, 100])
    assert [r.nbytes for r in regions] == [3 * MiB, 10 * MiB, 100]
    assert arena.capacity_bytes >= 13 * MiB and arena.capacity_bytes <= 13 * MiB + 8192
    capacity = arena.capacity_bytes
    for region in regions:
        arena.free(region)
    again = arena.allocate([10 * MiB, 3 * MiB])
    assert arena.capacity_bytes == capacity  # reused, not regrown
    for region in again:
        arena.free(region)
    arena.release()
    assert arena.capacity_bytes == 0


def test_chunk_plan_packs_first_fit() -> None:
    page = 4096
    # 6 and 4 share the first chunk, 5 needs a second; each is trimmed to what it holds.
    assert _chunk_plan([6 * page, 5 * page, 4 * page], 10 * page) == [10 * page, 5 * page]
    assert _chunk_plan([page, page, 2 * page], 1 << 20) == [4 * page]
    assert _chunk_plan([3 << 20], 1 << 20) == [3 << 20]  # larger than a chunk: a chunk of its own
