"""Many small allocations sleep and wake as few physical handles (pool.py): slabs that grow with
the tag, first-fit, freed when their last block dies; bit-exact through sleep, wake and a driver
call failing on a coalesced handle."""

from __future__ import annotations

import gc

import pytest
import torch

from dormant.memory import MemoryManager, SleepFailedError, State, TagState
from dormant.memory.allocation import Kind
from dormant.memory.host_backend import HostBackend
from dormant.memory.pool import COALESCE_FRACTION, SLAB_GROWTH, TagPool
from tests.memory.faults import FaultyBackend, check_truth, expect_driver_error
from tests.memory.helpers import random_fill, same_bytes

KiB, MiB = 1 << 10, 1 << 20
GRANULE = 64 * KiB


def manager(backend: HostBackend | FaultyBackend) -> MemoryManager:
    """64 KiB granules, slabs of 64 KiB to 4 MiB: blocks below 256 KiB share slabs."""
    return MemoryManager(backend, slab_bytes=GRANULE, max_slab_bytes=4 * MiB)


@pytest.fixture
def faulty() -> FaultyBackend:
    return FaultyBackend(HostBackend(granularity=GRANULE))


def test_small_blocks_share_few_growing_slabs() -> None:
    pool = TagPool(HostBackend(granularity=GRANULE), "t", GRANULE, 2 * MiB)
    assert pool.coalesce_limit == 2 * MiB // COALESCE_FRACTION
    blocks = [pool.allocate(GRANULE, Kind.RAW) for _ in range(512)]  # 32 MiB in 64 KiB blocks
    sizes = [a.size for a in pool.allocations]
    assert len(sizes) < 512 // 8, sizes  # one handle each would be 512
    assert sizes == sorted(sizes) and sizes[-1] == 2 * MiB  # they grow, up to the largest slab
    for earlier, size in enumerate(sizes):  # each new slab is at most 1/SLAB_GROWTH of before
        held = sum(sizes[:earlier])
        assert size <= max(GRANULE, held // SLAB_GROWTH), (earlier, sizes)
    assert pool.used_bytes == 512 * GRANULE
    slack = sum(sizes) - pool.used_bytes
    assert slack <= sum(sizes) // SLAB_GROWTH
    assert len({b.address for b in blocks}) == 512
    for block in blocks:
        pool.free(block)
    assert pool.allocations == [] and pool.used_bytes == 0


def test_blocks_at_the_limit_get_a_handle_of_their_own() -> None:
    pool = TagPool(HostBackend(granularity=GRANULE), "t", GRANULE, 4 * MiB)
    big = pool.allocate(pool.coalesce_limit, Kind.TENSOR)
    small = pool.allocate(pool.coalesce_limit - 1, Kind.TENSOR)
    assert big.slab is None and big.allocation.size == pool.coalesce_limit
    assert small.slab is not None and small.allocation.kind is Kind.SLAB


def test_a_slab_lives_until_its_last_block_and_gaps_are_reused() -> None:
    pool = TagPool(HostBackend(granularity=GRANULE), "t", GRANULE, 4 * MiB)
    a, b, c = (pool.allocate(20 * KiB, Kind.RAW) for _ in range(3))
    assert a.allocation is b.allocation is c.allocation
    pool.free(b)
    assert pool.free(a) is None and len(pool.allocations) == 1
    again = pool.allocate(40 * KiB, Kind.RAW)  # first fit: the gap a and b left
    assert again.address == a.address
    pool.free(c)
    assert pool.free(again) is c.allocation and pool.allocations == []


def test_coalesced_blocks_sleep_and_wake_bit_exact_in_few_driver_calls(
    faulty: FaultyBackend,
) -> None:
    mm = manager(faulty)
    tensors = [mm.empty((n,), torch.uint8, "cuda_graph") for n in [GRANULE] * 200 + [777] * 50]
    expected = [random_fill(t, seed) for seed, t in enumerate(tensors)]
    num_handles = len(list(mm._table.allocations(["cuda_graph"])))
    assert num_handles < 250 // 4
    faulty.arm()
    report = mm.sleep(level=1)
    assert faulty.calls["unmap"] == faulty.calls["release"] == num_handles
    assert faulty.calls["copy_batch.add"] == num_handles
    assert report.bytes_copied == mm.arena.used_bytes  # whole slabs, slack included
    faulty.arm()
    mm.wake_up()
    assert faulty.calls["create"] == faulty.calls["map"] == num_handles
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    check_truth(mm, faulty)
    del tensors
    gc.collect()
    mm.close()


@pytest.mark.parametrize("method,k", [("release", 3), ("unmap", 2), ("copy_batch.wait", 2)])
def test_a_failure_mid_sleep_on_a_coalesced_handle_keeps_the_truth_and_the_bytes(
    faulty: FaultyBackend, method: str, k: int
) -> None:
    mm = manager(faulty)
    tensors = [mm.empty((n,), torch.uint8, "cuda_graph") for n in [50 * KiB] * 60]
    expected = [random_fill(t, seed) for seed, t in enumerate(tensors)]
    faulty.arm(method, k)
    error = expect_driver_error(lambda: mm.sleep(level=1))
    assert isinstance(error, SleepFailedError) and "injected failure" in str(error)
    assert error.tag_states["cuda_graph"] is TagState.PARTIAL
    check_truth(mm, faulty)
    states = {a.state for a in mm._table.allocations(["cuda_graph"])}
    assert State.MAPPED in states and State.OFFLOADED in states
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    mm.sleep(level=1)  # and the next sleep completes
    assert mm.tag_states()["cuda_graph"] is TagState.OFFLOADED
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    del tensors
    gc.collect()
    mm.close()
    assert faulty.inner.live_handles() == {} and faulty.inner.live_reservations() == {}


def test_freeing_blocks_of_a_sleeping_slab_frees_it_with_the_last(faulty: FaultyBackend) -> None:
    mm = manager(faulty)
    tensors = [mm.empty((20 * KiB,), torch.uint8, "workspace") for _ in range(3)]
    (slab,) = mm._table.allocations(["workspace"])
    mm.sleep(level=1)
    del tensors[:2]
    gc.collect()
    assert list(mm._table.allocations(["workspace"])) == [slab]
    tensors.clear()
    gc.collect()
    assert list(mm._table.allocations(["workspace"])) == []
    assert faulty.inner.live_reservations() == {}
    mm.wake_up()
    mm.close()


@pytest.mark.gpu
def test_a_capture_scopes_segments_share_handles_and_come_back_bit_exact() -> None:
    """torch's caching allocator serves 1 MiB tensors from 2 MiB segments, one raw_alloc each:
    the shape of graph pools and capture scopes. They must not cost a handle each."""
    mm = MemoryManager("cuda")
    mm.register_tag("segments")
    with mm.capture("segments"):
        tensors = [torch.empty(MiB // 4, dtype=torch.float32, device="cuda") for _ in range(512)]
    for seed, t in enumerate(tensors):
        t.copy_(torch.randn(t.numel(), generator=torch.Generator().manual_seed(seed)))
    expected = [t.clone() for t in tensors]
    num_segments = sum(1 for r in mm._table.records() if r.tag == "segments")
    num_handles = len(list(mm._table.allocations(["segments"])))
    assert num_segments >= 256 and num_handles < num_segments // 4
    for _ in range(2):
        mm.sleep(tags={"segments": "host"})
        mm.wake_up()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))
    del tensors, expected
    gc.collect()
    mm.close()
