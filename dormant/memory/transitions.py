"""The byte-moving halves of sleep and wake, over a chosen set of allocations.

The manager decides *which* allocations change state; these functions make the change, in the
order DESIGN §2.3 requires, and report timings.

Sleep: synchronize → place host copies (arena) → hash → async copies → wait → unmap + release.
Wake: map everything (rolling back on any failure) → only then copy back / poison → MAPPED.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dormant.memory.allocation import Allocation, State
from dormant.memory.arena import HostArena, Region
from dormant.memory.backend import Backend, Copy
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
    If this raises before the release step, every allocation is still MAPPED with its contents.
    """
    t0 = time.perf_counter()
    backend.synchronize()  # never copy or unmap under running kernels
    t_sync = time.perf_counter()

    homeless = [a for a in host if a.region is None]
    if homeless:
        for allocation, region in zip(
            homeless, arena.allocate([a.size for a in homeless]), strict=True
        ):
            allocation.region, allocation.digest = region, None
    t_arena = time.perf_counter()

    digests: list[bytes | None] = [None] * len(host)
    if skip_unchanged and host:
        digests = list(backend.content_hashes([a.span for a in host]))
    t_hash = time.perf_counter()

    stale = [
        (a, d)
        for a, d in zip(host, digests, strict=True)
        if d is None or a.is_dirty or a.digest != d
    ]
    backend.copy_to_host([Copy(_region(a).address, a.va, a.size) for a, _ in stale])
    for allocation, digest in stale:
        allocation.digest, allocation.is_dirty = digest, False
    t_copy = time.perf_counter()

    for allocations, state in ((host, State.OFFLOADED), (discard, State.DISCARDED)):
        for allocation in allocations:
            backend.unmap(allocation.va, allocation.size)
            backend.release(allocation.handle)
            allocation.handle, allocation.state = None, state
    t_end = time.perf_counter()

    copied = sum(a.size for a, _ in stale)
    return SleepReport(
        total_s=t_end - t0,
        sync_s=t_sync - t0,
        arena_s=t_arena - t_sync,
        hash_s=t_hash - t_arena,
        copy_s=t_copy - t_hash,
        release_s=t_end - t_copy,
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
    mapped: list[tuple[Allocation, object]] = []
    try:
        for allocation in allocations:
            handle = backend.create(allocation.size)
            try:
                backend.map(allocation.va, allocation.size, handle)
            except BaseException:
                backend.release(handle)
                raise
            mapped.append((allocation, handle))
        t_map = time.perf_counter()
        offloaded = [a for a in allocations if a.state is State.OFFLOADED]
        backend.copy_to_device([Copy(a.va, _region(a).address, a.size) for a in offloaded])
        t_copy = time.perf_counter()
        discarded = [a.span for a in allocations if a.state is State.DISCARDED]
        if poison and discarded:
            backend.fill(discarded, POISON_BYTE)
    except BaseException as error:
        for allocation, handle in mapped:
            backend.unmap(allocation.va, allocation.size)
            backend.release(handle)
        if isinstance(error, OutOfMemoryError):
            needed = sum(a.size for a in allocations)
            free, _ = backend.memory_info()
            raise WakeOutOfMemoryError(
                f"wake needs {needed:,} bytes for {len(allocations)} allocations but only "
                f"{free:,} bytes are free; nothing was mapped and every tag is still asleep. "
                "Free device memory (e.g. the trainer's) and call wake_up again.",
                bytes_requested=needed,
                bytes_free=free,
            ) from error
        raise
    t_end = time.perf_counter()
    for allocation, handle in mapped:
        allocation.handle, allocation.state = handle, State.MAPPED
    return WakeReport(
        total_s=t_end - t0,
        map_s=t_map - t0,
        copy_s=t_copy - t_map,
        fill_s=t_end - t_copy,
        bytes_mapped=sum(a.size for a in allocations),
        bytes_copied=sum(a.size for a in offloaded),
    )


def _region(allocation: Allocation) -> Region:
    assert allocation.region is not None, "a HOST allocation always has an arena region"
    return allocation.region
