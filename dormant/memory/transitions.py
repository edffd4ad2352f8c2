"""The byte-moving halves of sleep and wake, over a chosen set of allocations.

The manager decides *which* allocations change state; these functions make the change in the
order DESIGN §2.3 requires, overlapping driver work with the copies, and report timings.

Sleep::

    synchronize the device           never copy or unmap under running kernels
    place host copies in the arena   (may grow it: an error here changes nothing)
    hash HOST allocations            unchanged since their last offload → no copy
    start the D2H copies             one per stale allocation, asynchronous
    release DISCARD + unchanged      while the copies run
    release each stale allocation    as soon as its own copy has landed

Wake::

    map each allocation, in order    starting its H2D copy as soon as it is mapped
    on any failure                   wait for the copies, unmap + release everything mapped
                                     here, leave every state as it was, raise
    poison DISCARD remaps (debug)    then wait for the copies, then mark MAPPED

Nothing is marked MAPPED until every allocation is mapped and restored, so a failed wake is
invisible; starting copies before the last map only overlaps work that a rollback throws away.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dormant.memory.allocation import Allocation, State
from dormant.memory.arena import HostArena, Region
from dormant.memory.backend import Backend, Copy, CopyBatch
from dormant.memory.errors import OutOfMemoryError, WakeOutOfMemoryError
from dormant.memory.status import SleepReport, WakeReport

POISON_BYTE = 0xFF


def sleep_allocations(
    backend: Backend,
    arena: HostArena,
    host: Sequence[Allocation],
    discard: Sequence[Allocation],
    *,
    skip_unchanged: bool,
) -> SleepReport:
    """Offloads ``host`` and discards ``discard``; all must be MAPPED.

    A HOST allocation whose content hash equals the digest of its arena copy is not copied again.
    An error before the copies start (arena growth, hashing) leaves every allocation MAPPED.
    """
    t0 = time.perf_counter()
    backend.synchronize()
    t_sync = time.perf_counter()

    homeless = [a for a in host if a.region is None]
    if homeless:
        regions = arena.allocate([a.size for a in homeless])
        for allocation, region in zip(homeless, regions, strict=True):
            allocation.region, allocation.digest = region, None
    t_arena = time.perf_counter()

    digests: list[bytes | None] = [None] * len(host)
    if skip_unchanged and host:
        digests = list(backend.content_hashes([a.span for a in host]))
    t_hash = time.perf_counter()

    stale = [(a, d) for a, d in zip(host, digests, strict=True) if _is_stale(a, d)]
    stale_ids = {id(a) for a, _ in stale}
    batch = backend.copy_batch()
    try:
        for allocation, _ in stale:
            batch.add(Copy(_region(allocation).address, allocation.va, allocation.size))
        for allocation in discard:
            _release(backend, allocation, State.DISCARDED)
        for allocation in host:
            if id(allocation) not in stale_ids:
                _release(backend, allocation, State.OFFLOADED)
        for index, (allocation, digest) in enumerate(stale):
            batch.wait(index)
            allocation.digest, allocation.is_dirty = digest, False
            _release(backend, allocation, State.OFFLOADED)
    finally:
        batch.wait_all()
    t_end = time.perf_counter()

    copied = sum(a.size for a, _ in stale)
    return SleepReport(
        total_s=t_end - t0,
        sync_s=t_sync - t0,
        arena_s=t_arena - t_sync,
        hash_s=t_hash - t_arena,
        copy_s=t_end - t_hash,  # copies, with the releases overlapped under them
        bytes_copied=copied,
        bytes_skipped=sum(a.size for a in host) - copied,
        bytes_released=sum(a.size for a in (*host, *discard)),
    )


def wake_allocations(
    backend: Backend, allocations: Sequence[Allocation], *, poison: bool
) -> WakeReport:
    """Maps every allocation at its own VA, then restores or poisons it. All or nothing.

    On any failure the memory mapped by this call is unmapped and released, every state is left as
    it was, and the error is raised (out-of-memory as WakeOutOfMemoryError with the byte counts).
    """
    t0 = time.perf_counter()
    # Offloaded allocations first: their copies start while the rest is being mapped.
    ordered = sorted(allocations, key=lambda a: a.state is not State.OFFLOADED)
    mapped: list[tuple[Allocation, object]] = []
    batch = backend.copy_batch()
    try:
        for allocation in ordered:
            handle = backend.create(allocation.size)
            try:
                backend.map(allocation.va, allocation.size, handle)
            except BaseException:
                backend.release(handle)
                raise
            mapped.append((allocation, handle))
            if allocation.state is State.OFFLOADED:
                batch.add(Copy(allocation.va, _region(allocation).address, allocation.size))
        t_map = time.perf_counter()
        discarded = [a.span for a in ordered if a.state is State.DISCARDED]
        if poison and discarded:
            backend.fill(discarded, POISON_BYTE)
        batch.wait_all()
    except BaseException as error:
        _roll_back(backend, batch, mapped)
        if isinstance(error, OutOfMemoryError):
            raise _wake_oom(backend, allocations) from error
        raise
    t_end = time.perf_counter()
    copied = sum(a.size for a in allocations if a.state is State.OFFLOADED)
    for allocation, handle in mapped:
        allocation.handle, allocation.state = handle, State.MAPPED
    return WakeReport(
        total_s=t_end - t0,
        map_s=t_map - t0,  # mapping, with the copies already running under it
        copy_s=t_end - t_map,
        bytes_mapped=sum(a.size for a in allocations),
        bytes_copied=copied,
    )


def _is_stale(allocation: Allocation, digest: bytes | None) -> bool:
    """Whether the arena copy must be (re)written: no digest to trust, a hint, or a change."""
    return digest is None or allocation.is_dirty or allocation.digest != digest


def _release(backend: Backend, allocation: Allocation, state: State) -> None:
    backend.unmap(allocation.va, allocation.size)
    backend.release(allocation.handle)
    allocation.handle, allocation.state = None, state


def _roll_back(backend: Backend, batch: CopyBatch, mapped: list[tuple[Allocation, object]]) -> None:
    batch.wait_all()  # no copy may still be writing into memory about to be released
    for allocation, handle in mapped:
        backend.unmap(allocation.va, allocation.size)
        backend.release(handle)


def _wake_oom(backend: Backend, allocations: Sequence[Allocation]) -> WakeOutOfMemoryError:
    needed = sum(a.size for a in allocations)
    free, _ = backend.memory_info()
    return WakeOutOfMemoryError(
        f"wake needs {needed:,} bytes for {len(allocations)} allocations but only {free:,} bytes "
        "are free; nothing was mapped and every tag is still asleep. Free device memory (e.g. the "
        "trainer's) and call wake_up again.",
        bytes_requested=needed,
        bytes_free=free,
    )


def _region(allocation: Allocation) -> Region:
    assert allocation.region is not None, "a HOST allocation always has an arena region"
    return allocation.region
