"""The byte-moving half of wake, over a chosen set of allocations (sleep: ``offload.py``).

The tag machine (``tag_machine.py``) decides *which* allocations wake; this maps them back in the
order DESIGN §2.3 requires, overlapping the copies with the maps, and reports timings.

Wake::

    map each allocation, in order    UNMAPPED: its own handle again (contents intact); others: a
                                     new handle, starting the H2D copy as soon as it is mapped
                                     (by the copy path the caller chose: copy_path.py)
    on any failure                   wait for the copies, unmap + release what this call created
                                     (unmap only, for a handle the allocation already held), leave
                                     every state as it was, raise
    poison DISCARD remaps (debug)    then wait for the copies, then mark MAPPED

Nothing is marked MAPPED until every allocation is mapped and restored, so a failed wake is
invisible; starting copies before the last map only overlaps work that a rollback throws away.
An OFFLOADED allocation without a valid host copy (unreachable with this ordering) comes back
zeroed (poisoned in poison mode) and is listed in ``WakeReport.lost``: never silent garbage.

Out of scope: a second driver failure while a failed wake is being rolled back is raised in place
of the first, and the allocations that rollback had not reached yet are not described truthfully.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dormant.memory.allocation import Allocation, State
from dormant.memory.backend import Backend, Copy, CopyBatch
from dormant.memory.copy_path import CopyPath
from dormant.memory.errors import OutOfMemoryError, WakeOutOfMemoryError
from dormant.memory.path_copies import PathCopies
from dormant.memory.status import WakeReport
from dormant.memory.steps import drain, handle_of, region_of

POISON_BYTE = 0xFF
_WAKE_ORDER = {State.OFFLOADED: 0, State.UNMAPPED: 1, State.DISCARDED: 2}


def wake_allocations(
    backend: Backend,
    allocations: Sequence[Allocation],
    *,
    poison: bool,
    copy_path: CopyPath = CopyPath.COPY_ENGINE,
    sm_fraction: float = 0.5,
) -> WakeReport:
    """Maps every allocation (none MAPPED) at its own VA, then restores or poisons it, copying
    by ``copy_path`` (``sm_fraction`` of each copy by SM kernels under HYBRID). All or nothing.

    On any failure the memory mapped by this call is unmapped, what it created is released, every
    state is left as it was, and the error is raised (out-of-memory as WakeOutOfMemoryError with
    the byte counts).
    """
    t0 = time.perf_counter()
    # Offloaded allocations first: their copies start while the rest is being mapped.
    ordered = sorted(allocations, key=lambda a: _WAKE_ORDER[a.state])
    created: list[tuple[Allocation, int]] = []  # new handles, mapped
    remapped: list[Allocation] = []  # UNMAPPED allocations whose own handle is mapped again
    lost: list[Allocation] = []
    num_copies = 0
    batch = PathCopies(backend, copy_path, sm_fraction)
    try:
        for allocation in ordered:
            if allocation.state is State.UNMAPPED:
                backend.map(allocation.va, allocation.size, handle_of(allocation))
                remapped.append(allocation)
                continue
            handle = backend.create(allocation.size)
            try:
                backend.map(allocation.va, allocation.size, handle)
            except BaseException:
                backend.release(handle)
                raise
            created.append((allocation, handle))
            if allocation.state is State.OFFLOADED and allocation.has_host_copy:
                batch.add(Copy(allocation.va, region_of(allocation).address, allocation.size))
                num_copies += 1
            elif allocation.state is State.OFFLOADED:
                lost.append(allocation)
        t_map = time.perf_counter()
        refilled = [a.span for a in ordered if a.state is State.DISCARDED] + [a.span for a in lost]
        if poison and refilled:
            backend.fill(refilled, POISON_BYTE)
        if num_copies:  # a wake that only maps (the KV cache) waits for nothing
            batch.wait_all()
    except BaseException as error:
        _roll_back(backend, batch, created, remapped, error)
        if isinstance(error, OutOfMemoryError):
            raise _wake_oom(backend, allocations) from error
        raise
    t_end = time.perf_counter()
    copied = sum(a.size for a, _ in created if a.state is State.OFFLOADED and a not in lost)
    for allocation, handle in created:
        allocation.handle, allocation.state = handle, State.MAPPED
    for allocation in remapped:
        allocation.state, allocation.pending = State.MAPPED, None
    return WakeReport(
        total_s=t_end - t0,
        map_s=t_map - t0,  # mapping, with the copies already running under it
        copy_s=t_end - t_map,
        bytes_mapped=sum(a.size for a in allocations),
        bytes_copied=copied,
        lost=_bytes_by_tag(lost),
        copy_path=copy_path if num_copies else None,
        bytes_copy_engine=batch.bytes_by_path[CopyPath.COPY_ENGINE],
        bytes_sm=batch.bytes_by_path[CopyPath.SM],
    )


def _roll_back(
    backend: Backend,
    batch: CopyBatch,
    created: list[tuple[Allocation, int]],
    remapped: list[Allocation],
    error: BaseException,
) -> None:
    drain(batch, error)  # no copy may still be writing into memory about to be released
    for allocation, handle in created:
        backend.unmap(allocation.va, allocation.size)
        backend.release(handle)
    for allocation in remapped:
        backend.unmap(allocation.va, allocation.size)  # it stays UNMAPPED, holding its handle


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


def _bytes_by_tag(allocations: Sequence[Allocation]) -> tuple[tuple[str, int], ...]:
    totals: dict[str, int] = {}
    for allocation in allocations:
        totals[allocation.tag] = totals.get(allocation.tag, 0) + allocation.size
    return tuple(totals.items())
